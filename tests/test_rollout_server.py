"""Rollouts from a rollout server (rollout/server/) through the client engine (rollout/remote.py):
the weight transport, several servers, and the faults: no server, another model, weights other
than pushed, a second trainer, a server that dies or restarts. The engine contract suite runs
against the client too (tests/test_engine_contract.py, ``remote-*``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from gspo_lightning.errors import RolloutServerError
from gspo_lightning.rollout import HFEngine, RemoteEngine, SamplingParams
from gspo_lightning.rollout.remote import request_json, split_evenly
from gspo_lightning.rollout.sampling import server_share_seed
from gspo_lightning.rollout.transport import FolderTransport, WeightsChecksum
from gspo_lightning.rollout.weight_sync import iter_policy_weights
from tests.helpers import serve_in_thread
from tests.helpers_server import HF, MODEL, free_port, policy_and_spec, prompts, serve_on, shut

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def server():
    app, httpd, url = serve_in_thread(MODEL, HF, prompt_length=8, response_length=6)
    yield app, url
    httpd.shutdown()
    app.close()


def start_process_server(tmp_path, port: int) -> subprocess.Popen:
    """``gspo serve --config configs/quickstart_server.yaml --port port``, ready when this returns."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "gspo_lightning.cli", "serve", "--config",
                                str(ROOT / "configs/quickstart_server.yaml"), "--port", str(port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            request_json(f"http://127.0.0.1:{port}", "/health", timeout=2)
            return process
        except Exception:  # noqa: BLE001 - not up yet
            assert process.poll() is None, "the server process exited"
            time.sleep(0.2)
    process.kill()
    raise AssertionError("server did not start")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


# -- the configs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("served, twin", [("quickstart_server.yaml", "quickstart.yaml"),
                                          ("quickstart_vllm_server.yaml", "quickstart_vllm.yaml")])
def test_the_server_quickstarts_are_their_twins_with_rollouts_from_a_server(served, twin):
    import yaml

    from gspo_lightning.run.serve import spec_from_config

    a, b = (yaml.safe_load((ROOT / "configs" / name).read_text()) for name in (served, twin))
    engine = a["model"].pop("engine")
    assert engine["class_path"] == "gspo_lightning.rollout.RemoteEngine" and engine["init_args"]["urls"] is None
    hosted = b["model"].pop("engine", None) or {"class_path": "gspo_lightning.rollout.HFEngine"}
    assert spec_from_config({"model": {"engine": engine}}).engine == hosted  # gspo serve hosts the twin's engine
    for config in (a, b):
        del config["trainer"]["default_root_dir"]  # the run folder (the loggers follow it) differs
    assert a == b


# -- the transport -----------------------------------------------------------------------------------
def test_checksum_is_sha256_of_name_dtype_shape_and_bytes():
    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([1, 2], dtype=torch.int64)
    naive = hashlib.sha256()
    for name, t in [("a", a), ("b", b)]:
        naive.update(f"{name}|{str(t.dtype)[6:]}|{tuple(t.shape)}|".encode() + t.numpy().tobytes())
    checksum = WeightsChecksum()
    checksum.update("a", a)
    checksum.update("b", b)
    assert checksum.hexdigest() == naive.hexdigest() and checksum.bytes == 6 * 4 + 2 * 8
    other = WeightsChecksum()
    other.update("a", a + 1e-7)  # one rounding step in one element
    other.update("b", b)
    assert other.hexdigest() != naive.hexdigest()


def test_folder_transport_streams_buckets_in_order_and_removes_the_old_version(tmp_path):
    weights = [(f"w{i}", torch.full((256,), float(i))) for i in range(5)]  # 1 KiB each
    transport = FolderTransport(path=str(tmp_path), bucket_mb=2.5 / 1024)  # 2 tensors per bucket
    manifest = transport.send(iter(weights), version=3)
    assert [len(f["names"]) for f in manifest["files"]] == [2, 2, 1]
    assert manifest["names"] == [n for n, _ in weights] and manifest["bytes"] == 5 * 1024
    received = list(transport.receive(manifest))
    assert [n for n, _ in received] == manifest["names"]
    assert all(torch.equal(t, w) for (_, t), (_, w) in zip(received, weights))
    transport.sent(manifest)
    second = transport.send(iter(weights[:1]), version=4)
    transport.sent(second)
    assert not (tmp_path / "v3").exists() and (tmp_path / "v4").is_dir()
    transport.close()
    assert not (tmp_path / "v4").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_the_nccl_transport_says_what_it_needs_without_cuda(server):
    from gspo_lightning.rollout.transport import NCCLTransport

    with pytest.raises(RuntimeError, match="NCCLTransport needs CUDA GPUs and NCCL.*use .*FolderTransport"):
        NCCLTransport().send(iter([("w", torch.zeros(2))]), 0)
    app, url = server
    _, _, spec = policy_and_spec()
    client = RemoteEngine(urls=[url])
    client.start(spec)
    with pytest.raises(RolloutServerError, match="NCCLTransport needs CUDA"):  # the server side says it too
        request_json(url, "/weights", {"token": client.token, "version": 0, "manifest": {"kind": "nccl", "names": []}},
                     secret=os.environ["GSPO_SERVER_TOKEN"])
    client.close()


def test_prompts_are_split_in_whole_prompts_and_the_first_share_keeps_the_seed():
    assert split_evenly(5, 2) == [(0, 3), (3, 5)] and split_evenly(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert server_share_seed(42, 0) == 42 and len({server_share_seed(42, k) for k in range(4)}) == 4


# -- generation through the server ---------------------------------------------------------------------
def test_one_server_samples_exactly_as_the_colocated_engine(server):
    app, url = server
    policy, tok, spec = policy_and_spec(seed=5)
    client = RemoteEngine(urls=[url])
    client.start(spec)
    stats = client.update_weights(iter_policy_weights(policy), 0)
    assert stats["bytes"] == sum(p.numel() * 4 for p in policy.parameters())
    local = HFEngine()
    local.start(spec)
    params = SamplingParams(6, temperature=1.0)
    remote, colocated = client.generate(prompts(tok), 4, params, 17), local.generate(prompts(tok), 4, params, 17)
    assert torch.equal(remote.completion_ids, colocated.completion_ids) and torch.equal(remote.lengths, colocated.lengths)
    assert torch.equal(remote.logprobs, colocated.logprobs) and torch.equal(remote.truncated, colocated.truncated)
    assert remote.weights_version == 0
    client.close()


def test_several_servers_share_the_prompts_in_whole_groups(server):
    app2, httpd2, url2 = serve_in_thread(MODEL, HF, prompt_length=8, response_length=6)
    try:
        policy, tok, spec = policy_and_spec(seed=5)
        client, single = RemoteEngine(urls=[server[1], url2]), RemoteEngine(urls=[url2])
        client.start(spec)
        client.update_weights(iter_policy_weights(policy), 0)
        params = SamplingParams(6)
        both = client.generate(prompts(tok, 4), 3, params, 9)
        client.close()
        single.start(spec)
        single.update_weights(iter_policy_weights(policy), 0)
        first_half = single.generate(prompts(tok, 2), 3, params, 9)  # server 1's share, with the step's seed
        assert both.completion_ids.shape[0] == 12 and app2.version == 0 and server[0].version == 0
        width = first_half.completion_ids.shape[1]
        assert torch.equal(both.completion_ids[:6, :width], first_half.completion_ids)
        single.close()
    finally:
        httpd2.shutdown()
        app2.close()


def test_a_generation_asked_for_an_older_version_gets_the_newer_one_and_says_so(server):
    """``generate`` beside training (asynchronous GSPO): a push lands while the request is on its way."""
    _, url = server
    policy, tok, spec = policy_and_spec(seed=1)
    client = RemoteEngine(urls=[url])
    client.start(spec)
    client.update_weights(iter_policy_weights(policy), 4)
    client.update_weights(iter_policy_weights(policy), 5)
    client.weights_version = 4  # the version a background producer read before the push
    generation = client.generate(prompts(tok), 2, SamplingParams(6), 0)
    assert generation.weights_version == 5
    client.close()


def test_the_worker_tags_a_rollout_with_the_version_the_engine_reports():
    from gspo_lightning.rollout import Generation, RolloutEngine, RolloutWorker
    from gspo_lightning.rewards.base import RewardComposer

    class Fixed(RolloutEngine):
        reported = None

        def start(self, spec):
            pass

        def generate(self, prompt_ids, n, params, seed):
            rows = len(prompt_ids) * n
            return Generation(torch.full((rows, 2), 5), torch.full((rows, 2), -0.5), torch.full((rows,), 2),
                              torch.zeros(rows, dtype=torch.bool), weights_version=self.reported)

    _, tok, _ = policy_and_spec()
    engine = Fixed()
    engine.weights_version = 3
    rewards = RewardComposer([{"function": "gspo_lightning.data.tasks.successor.successor_reward"}])
    worker = RolloutWorker(engine, rewards, tok, train_params=SamplingParams(2), group_size=2,
                           eval_params=SamplingParams(2), eval_group_size=1)
    batch = {"prompt_ids": prompts(tok, 2), "prompt_text": ["next 1", "next 7"], "columns": {"target": ["2", "8"]}}
    assert worker.rollout(batch, seed=0, device=torch.device("cpu")).policy_version == 3  # none reported: the engine's
    engine.reported = 7
    assert worker.rollout(batch, seed=0, device=torch.device("cpu")).policy_version == 7


# -- faults --------------------------------------------------------------------------------------------
def test_no_server_at_start_is_one_line_naming_the_url_and_how_to_start_one(tmp_path, capsys):
    from gspo_lightning.cli import main

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs/quickstart_server.yaml"), f"--model.engine.init_args.urls=[{url}]",
              f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false", "--trainer.max_steps=1"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gspo: error")]
    assert len(errors) == 1 and f"no rollout server answers at {url}" in errors[0] and "gspo serve --config" in errors[0]


def test_a_server_serving_another_model_is_refused_at_start():
    app, httpd, url = serve_in_thread("builtin:tiny-successor-h32", HF)  # the same shapes, other heads
    try:
        _, _, spec = policy_and_spec(MODEL)
        with pytest.raises(RolloutServerError, match="serves another model"):
            RemoteEngine(urls=[url]).start(spec)
    finally:
        httpd.shutdown()
        app.close()


def test_a_server_that_does_not_load_the_pushed_weights_is_refused(server, monkeypatch):
    app, url = server
    monkeypatch.setattr(app, "_load_pairs", lambda pairs, version: [None for _ in pairs])  # reads, keeps its own
    policy, _, spec = policy_and_spec(seed=1)
    client = RemoteEngine(urls=[url])
    client.start(spec)
    with pytest.raises(RolloutServerError, match="does not hold the pushed weights"):
        client.update_weights(iter_policy_weights(policy), 0)
    client.close()


def test_a_rollout_from_weights_changed_behind_the_trainer_is_refused(server):
    app, url = server
    policy, tok, spec = policy_and_spec(seed=1)
    client = RemoteEngine(urls=[url])
    client.start(spec)
    client.update_weights(iter_policy_weights(policy), 2)
    client.generate(prompts(tok), 2, SamplingParams(6), 0)
    # another process loads other weights under the same version number
    other, _, _ = policy_and_spec(seed=2)
    transport = FolderTransport()
    app.load(client.token, 2, transport.send(iter_policy_weights(other), 2))
    transport.close()
    with pytest.raises(RolloutServerError, match="rollout refused"):
        client.generate(prompts(tok), 2, SamplingParams(6), 0)
    client.close()


def test_a_second_trainer_is_refused_until_the_first_lets_go(server):
    _, url = server
    _, _, spec = policy_and_spec()
    first, second = RemoteEngine(urls=[url]), RemoteEngine(urls=[url])
    first.start(spec)
    with pytest.raises(RolloutServerError, match="in use by another trainer"):
        second.start(spec)
    first.close()
    second.start(spec)  # the first closed its session
    second.close()


def test_a_restarted_server_gets_the_weights_again_and_samples_the_same():
    port = free_port()
    app, httpd = serve_on(port)
    policy, tok, spec = policy_and_spec(seed=4)
    client = RemoteEngine(urls=[f"http://127.0.0.1:{port}"], reconnect_s=60)
    client.start(spec)
    client.update_weights(iter_policy_weights(policy), 7)
    before = client.generate(prompts(tok), 4, SamplingParams(6), 3)
    shut(httpd)
    restarted = {}
    timer = threading.Timer(1.5, lambda: restarted.update(zip(("app", "httpd"), serve_on(port))))
    timer.start()
    try:
        after = client.generate(prompts(tok), 4, SamplingParams(6), 3)  # waits, re-pushes version 7, generates
        assert restarted["app"].server_id != app.server_id and restarted["app"].version == 7
        assert torch.equal(before.completion_ids, after.completion_ids) and after.weights_version == 7
        client.close()
    finally:
        timer.join()
        shut(restarted["httpd"])


def test_a_server_that_stays_away_stops_the_rollout_after_reconnect_s():
    port = free_port()
    _, httpd = serve_on(port)
    policy, tok, spec = policy_and_spec()
    client = RemoteEngine(urls=[f"http://127.0.0.1:{port}"], reconnect_s=1.0)
    client.start(spec)
    client.update_weights(iter_policy_weights(policy), 0)
    shut(httpd)
    start = time.monotonic()
    with pytest.raises(RolloutServerError, match="did not recover within 1 s"):
        client.generate(prompts(tok), 2, SamplingParams(6), 0)
    assert time.monotonic() - start < 10
    client.close()


@pytest.mark.slow
def test_a_started_server_ends_with_a_trainer_killed_without_cleanup(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(
        "import os, signal\n"
        "from gspo_lightning.rollout.child_server import ChildServer\n"
        "from gspo_lightning.rollout.server import ServerSpec\n"
        f"child = ChildServer(ServerSpec({MODEL!r}, prompt_length=8, response_length=6))\n"
        "url = child.start(120)\n"
        "print('STARTED', child.process.pid, url, child.folder.name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no close()\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    _, pid, url, folder = next(line for line in result.stdout.splitlines() if line.startswith("STARTED")).split()
    shutil.rmtree(folder)  # what the killed trainer could not remove
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status")
        gone = not status.exists() or "\nState:\tZ" in status.read_text()
        if gone:
            break
        time.sleep(0.5)
    else:
        os.kill(int(pid), 9)
        raise AssertionError("the server outlived the trainer that started it")
    with pytest.raises(Exception):
        request_json(url, "/health", timeout=2)


@pytest.mark.slow
def test_fit_writes_a_checkpoint_when_the_server_dies_and_resume_continues(tmp_path):
    """``gspo fit`` against a server that a reward function kills at the 3rd step."""
    port = free_port()
    process = start_process_server(tmp_path, port)
    config = tmp_path / "cfg.yaml"
    config.write_text((ROOT / "configs/quickstart_server.yaml").read_text().replace(
        "function: gspo_lightning.data.tasks.successor.successor_reward", "function: tests.helpers.reward_that_kills_a_server"))
    run = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(config),
           f"--model.engine.init_args.urls=[http://127.0.0.1:{port}]", "--model.engine.init_args.reconnect_s=2",
           f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
           "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=0", "--model.export_on_fit_end=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "GSPO_TEST_KILL_PID": str(process.pid),
           "GSPO_TEST_KILL_AT_CALL": "3"}
    try:
        first = subprocess.run(run + ["--trainer.max_steps=6"], env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert first.returncode == 2, first.stderr[-2000:]
        ckpt = tmp_path / "checkpoints" / "last.ckpt"
        output = first.stdout + first.stderr
        assert ckpt.is_file() and f"resume with --ckpt_path {ckpt}" in output and "did not recover within 2 s" in output
        assert torch.load(ckpt, weights_only=True)["global_step"] == 3  # the server died after step 3's rollout
        process = start_process_server(tmp_path, port)
        env["GSPO_TEST_KILL_AT_CALL"] = "0"
        second = subprocess.run(run + ["--trainer.max_steps=5", f"--ckpt_path={ckpt}"], env=env, capture_output=True,
                                text=True, cwd=ROOT, timeout=300)
        assert second.returncode == 0, second.stderr[-2000:]
        assert "max_steps=5` reached" in second.stdout + second.stderr
    finally:
        stop(process)


# -- a 2-rank trainer feeding one server -----------------------------------------------------------------
def launch(out_dir: Path, strategy: str, engines: tuple[str, ...], env: Optional[dict] = None) -> dict[str, dict]:
    """The runs named by ``engines``, one after the other in one torchrun launch, by the file
    each saved (a repeated engine saves ``<engine>_again``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests/distributed/server_worker.py"), "--strategy", strategy, "--out_dir", str(out_dir),
           "--engines", *engines]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {path.stem: torch.load(path) for path in out_dir.glob("*.pt")}


def assert_same_weights(state: dict, expected: dict, what: str) -> None:
    for name, value in expected.items():
        assert torch.equal(state[name], value), f"{what}: {name}: max diff {(state[name] - value).abs().max()}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_feeding_one_server_equal_the_colocated_run(tmp_path, strategy):
    # DDP runs the colocated case twice: a repeat must be bitwise equal (the policy's DDP
    # wrapper with gradient_as_bucket_view=True made the 2nd and later steps differ run to run)
    engines = ("colocated", "server", "stock", "colocated") if strategy == "ddp" else ("colocated", "server", "stock")
    port = free_port()
    stock_server = start_process_server(tmp_path, port)  # the stock-vLLM client's, through vLLM's routes
    try:
        runs = launch(tmp_path, strategy, engines, env={"GSPO_TEST_STOCK_URL": f"http://127.0.0.1:{port}"})
    finally:
        stop(stock_server)
    colocated, served = runs["colocated"], runs["server"]
    if strategy == "ddp":
        assert runs["colocated_again"]["rewards"] == colocated["rewards"]
        assert_same_weights(runs["colocated_again"]["state"], colocated["state"], "the colocated run repeated")
    assert served["world"] == 2
    # the server holds exactly the trainer's full weights after a push (checksum of what it holds)
    assert served["server_checksum"] == served["trainer_checksum"] and served["server_version"] >= 3
    # same seeds, same samples, same updates; through vLLM's routes too (rank 0 reloads, both ranks sample)
    assert runs["stock"]["rewards"] == colocated["rewards"]
    assert_same_weights(runs["stock"]["state"], colocated["state"], "stock client vs colocated")
    assert_same_weights(served["state"], colocated["state"], "served vs colocated")
