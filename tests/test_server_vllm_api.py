"""``gspo serve`` speaking vLLM's API (rollout/server/vllm_api.py): the client of stock vLLM
servers (``StockVLLMEngine``) drives it unchanged, a run through it equals a run through our own
protocol (``RemoteEngine``) step for step, and its new routes hold under hostile requests on
127.0.0.1 (the secret on every route, weights read only from this user's folders under the root,
bounded requests, a pause that cannot hold a generation forever)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from gspo_lightning.rollout import SamplingParams
from gspo_lightning.rollout.stock_vllm import StockServerError, StockVLLMEngine
from gspo_lightning.rollout.server import RolloutServer, ServerLimits, ServerSpec, http_server
from gspo_lightning.rollout.weight_sync import iter_policy_weights
from tests.helpers_fit import metric_rows
from tests.helpers_server import HF, MODEL, policy_and_spec, prompts

ROOT = Path(__file__).resolve().parents[1]
SECRET = os.environ["GSPO_SERVER_TOKEN"]
LIMITS = ServerLimits(max_prompts=8, max_prompt_tokens=16, max_n=8, max_responses=32)


class Served:
    """An HF-engine server on a free loopback port, counting the engine's generations and loads."""

    def __init__(self, weights_root: Path, version_wait_s: float = 120.0, limits: ServerLimits = LIMITS):
        self.app = RolloutServer(ServerSpec(MODEL, prompt_length=8, response_length=6, engine=HF), limits=limits,
                                 weights_root=str(weights_root), version_wait_s=version_wait_s)
        self.app.start()
        self.generations, self.loads = [], []
        generate, load = self.app.engine.generate, self.app._load_pairs
        self.app.engine.generate = lambda prompts_, *a: self.generations.append(len(prompts_)) or generate(prompts_, *a)
        self.app._load_pairs = lambda *a: self.loads.append(1) or load(*a)
        self.httpd = http_server(self.app, "127.0.0.1", 0, secret=SECRET)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def call(self, path: str, body=None, secret=SECRET) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=None if body is None else json.dumps(body).encode(),
                                         method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {secret}"} if secret else {})})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.app.close()


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    server = Served(root)
    yield server
    server.close()


def engine_on(urls: list[str], spec, weights_dir: Path) -> StockVLLMEngine:
    engine = StockVLLMEngine(base_urls=urls, api_key_env="GSPO_SERVER_TOKEN", weights_dir=str(weights_dir))
    engine.start(spec)
    return engine


def logprobs_under(policy, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = policy(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_the_stock_engine_samples_and_reloads_weights_through_gspo_serve(served, tmp_path):
    """One request per replica (its prompts batched by the HF engine), each sample's log-probs the
    policy's own; a reload through pause / reload_weights / version / resume makes the server
    sample from the pushed weights, the tied head included, and stamps the version."""
    policy, tok, spec = policy_and_spec(seed=3)
    second = Served(served.app.weights_root)
    try:
        engine = engine_on([served.url, second.url], spec, Path(served.app.weights_root))
        assert engine.batching == {served.url, second.url}
        torch.manual_seed(11)
        with torch.no_grad():  # weights other than the servers' random start: the reload must carry them
            for param in policy.parameters():
                param.add_(torch.randn_like(param) * 0.5)
        report = engine.update_weights(iter_policy_weights(policy), 4)
        assert report["tensors"] == len(list(policy.parameters())) and served.loads == second.loads == [1]
        assert served.app.version == second.app.version == 4 and not served.app.paused
        asked = prompts(tok, 3)
        generation = engine.generate(asked, 2, SamplingParams(max_new_tokens=6, temperature=1.0), seed=7)
        assert served.generations == [2] and second.generations == [1]  # prompts 0, 2 and prompt 1: one call each
        worst = 0.0
        for row in range(6):
            length = int(generation.lengths[row])
            completion = generation.completion_ids[row, :length].tolist()
            expected = logprobs_under(policy, asked[row // 2], completion)
            worst = max(worst, float((generation.logprobs[row, :length] - expected).abs().max()))
        assert worst < 1e-5
        assert generation.weights_version == 4
        again = engine.generate(asked, 2, SamplingParams(max_new_tokens=6, temperature=1.0), seed=7)
        assert torch.equal(again.completion_ids, generation.completion_ids)  # one seed per request: reproducible
        engine.close()
    finally:
        second.close()


def test_a_run_through_vllms_routes_equals_a_run_through_our_protocol(tmp_path, monkeypatch, request):
    """The quickstart for 3 steps against one gspo serve, once with StockVLLMEngine (vLLM's routes)
    and once with RemoteEngine (/session, /weights, /generate): the same rollouts, so the same
    rewards, losses and clip fractions at every step."""
    from gspo_lightning.cli import main

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    served = Served(root, limits=ServerLimits())  # a quickstart step asks for 16 prompts x 8
    request.addfinalizer(served.close)
    common = ["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.max_steps=3",
              "--trainer.val_check_interval=1000", "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
              "--model.export_on_fit_end=false", "--trainer.enable_checkpointing=false", "--export=last",
              "--seed_everything=5"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    main([*common, f"--trainer.default_root_dir={tmp_path / 'stock'}", "--model.engine.class_path=gspo_lightning.rollout.StockVLLMEngine",
          f"--model.engine.init_args.base_urls=[{served.url}]", "--model.engine.init_args.api_key_env=GSPO_SERVER_TOKEN",
          f"--model.engine.init_args.weights_dir={served.app.weights_root}"])
    assert len(served.loads) == 3  # a reload before each step's rollout
    main([*common, f"--trainer.default_root_dir={tmp_path / 'remote'}", "--model.engine.class_path=gspo_lightning.rollout.RemoteEngine",
          f"--model.engine.init_args.urls=[{served.url}]",
          "--model.engine.init_args.transport.class_path=gspo_lightning.rollout.transport.FolderTransport",
          f"--model.engine.init_args.transport.init_args.path={served.app.weights_root}"])
    stock, remote = metric_rows(tmp_path / "stock"), metric_rows(tmp_path / "remote")
    assert len(stock) == 3 and stock.keys() == remote.keys()
    for version in stock:
        for key in ("reward/mean", "loss/policy", "loss/clip_frac", "loss/ratio_max", "response/length_max"):
            assert float(stock[version][key]) == pytest.approx(float(remote[version][key]), abs=1e-6), key


# -- hostile requests ---------------------------------------------------------------------------------
VLLM_ROUTES = [("GET", "/v1/models", None), ("GET", "/is_paused", None), ("POST", "/pause?mode=wait", {}),
               ("POST", "/resume", {}), ("POST", "/update_weight_version", {"new_version": "9"}),
               ("POST", "/reset_prefix_cache", {}),
               ("POST", "/v1/completions", {"prompt": [3, 4], "max_tokens": 2, "logprobs": 0}),
               ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/dev/shm"}})]


@pytest.mark.parametrize("method, path, body", VLLM_ROUTES)
@pytest.mark.parametrize("secret", [None, "wrong-secret-of-32-characters-xx"])
def test_every_vllm_route_needs_the_secret_and_does_nothing_without_it(served, method, path, body, secret):
    status, reply = served.call(path, body, secret=secret)
    assert status == 401 and reply["kind"] == "unauthorized"
    assert served.generations == [] and served.loads == [] and not served.app.paused and served.app.version == -1


def weights_folder(root: Path, name: str = "v1", mode: int = 0o755) -> Path:
    from safetensors.torch import save_file

    policy, _, _ = policy_and_spec(seed=1)
    folder = root / name
    folder.mkdir(mode=mode)
    folder.chmod(mode)
    save_file({k: v.clone() for k, v in policy.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def reload(served, path) -> tuple[int, dict]:
    return served.call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})


def test_weights_are_read_only_from_this_users_folders_under_the_root(served, tmp_path):
    root = Path(served.app.weights_root)
    outside = weights_folder(tmp_path, "outside")
    writable = weights_folder(root, "writable", mode=0o777)
    inside = weights_folder(root)
    (root / "link").symlink_to(outside)
    linked_file = root / "linked"
    linked_file.mkdir(mode=0o755)
    (linked_file / "model.safetensors").symlink_to(outside / "model.safetensors")
    for path in (outside, root / "link", root / "v1" / ".." / ".." / "outside", "relative/v1", root, writable,
                 linked_file):
        status, reply = reload(served, path)
        assert status == 400, (path, reply)
    assert served.loads == [] and served.app.version == -1
    status, reply = served.call("/collective_rpc", {"method": "execute_model", "kwargs": {}})
    assert status == 400 and "reload_weights" in reply["error"]
    status, reply = reload(served, inside)
    policy, _, _ = policy_and_spec(seed=1)
    assert status == 200 and reply["results"][0]["tensors"] == len(policy.state_dict()) and served.loads == [1]
    held = dict(served.app.held_model.named_parameters())
    assert all(torch.equal(held[name], value) for name, value in policy.named_parameters())


@pytest.mark.parametrize("change, says", [
    ({"prompt": "next 1"}, "token ids"),
    ({"prompt": [[3] * 17]}, "max_prompt_tokens"),
    ({"prompt": [[3]] * 9}, "max_prompts"),
    ({"n": 9}, "max_n"),
    ({"max_tokens": 7}, "response_length"),
    ({"stop_token_ids": [4]}, "EOS"),
    ({"temperature": float("nan")}, "finite"),
    ({"logprobs": 5}, "top-k"),
    ({"stream": True}, "stream"),
    ({"guided_json": {}}, "guided_json"),
    ({"prompt": [3, 99]}, "vocabulary"),
])
def test_completion_requests_are_bounded_and_refused_by_name(served, change, says):
    body = {"prompt": [3, 4], "max_tokens": 2, "logprobs": 0, **change}
    raw = json.dumps(body).replace("NaN", "1e999")  # a non-finite number as a client would send it
    request = urllib.request.Request(served.url + "/v1/completions", data=raw.encode(), method="POST",
                                     headers={"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400 and says in json.loads(refused.value.read())["error"]
    assert served.generations == []
    status, reply = served.call("/v1/completions", {"prompt": [3, 4], "max_tokens": 2, "logprobs": 0, "n": 2})
    assert status == 200 and len(reply["choices"]) == 2 and reply["choices"][0]["logprobs"]["token_logprobs"]


def test_another_model_name_is_404_and_pause_cannot_abort(served):
    status, reply = served.call("/v1/completions", {"model": "other", "prompt": [3], "max_tokens": 1})
    assert status == 404 and "builtin:tiny-successor" in reply["error"]
    status, reply = served.call("/pause?mode=abort", {})
    assert status == 400 and "mode=wait" in reply["error"] and not served.app.paused
    status, reply = served.call("/update_weight_version", {"new_version": "1e9"})
    assert status == 400 and served.app.version == -1


def test_a_paused_server_holds_generations_until_resumed_and_never_forever(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    served = Served(root, version_wait_s=1.5)
    try:
        assert served.call("/pause?mode=wait", {})[0] == 200 and served.call("/is_paused")[1] == {"is_paused": True}
        start = time.monotonic()
        status, reply = served.call("/v1/completions", {"prompt": [3, 4], "max_tokens": 2})
        assert status == 409 and "POST /resume" in reply["error"] and 1.4 < time.monotonic() - start < 10
        assert served.generations == []
        answered = []
        waiting = threading.Thread(target=lambda: answered.append(served.call("/v1/completions",
                                                                              {"prompt": [3, 4], "max_tokens": 2})))
        waiting.start()
        time.sleep(0.5)
        assert not answered  # held while paused
        served.call("/resume", {})
        waiting.join(10)
        assert answered and answered[0][0] == 200 and served.generations == [1]
    finally:
        served.close()


def test_a_wrong_key_from_the_stock_engine_is_one_line(served, monkeypatch, tmp_path):
    _, _, spec = policy_and_spec()
    monkeypatch.setenv("WRONG_KEY", "wrong-secret-of-32-characters-xx")
    engine = StockVLLMEngine(base_urls=[served.url], api_key_env="WRONG_KEY", weights_dir=str(tmp_path))
    with pytest.raises(StockServerError, match="refused the key"):
        engine.start(spec)
    engine.close()


def test_prompts_of_one_key_go_to_one_replica(served, tmp_path):
    """``affinity`` (an episode's group) picks the replica: keys 1, 1, 0 send two prompts to the
    second server and one to the first; without it the prompts go in turn."""
    _, tok, spec = policy_and_spec()
    second = Served(served.app.weights_root)
    try:
        engine = engine_on([served.url, second.url], spec, Path(served.app.weights_root))
        params = SamplingParams(max_new_tokens=3)
        engine.generate(prompts(tok, 3), 1, params, seed=1, affinity=[1, 1, 0])
        assert served.generations == [1] and second.generations == [2]
        engine.generate(prompts(tok, 3), 1, params, seed=1)
        assert served.generations == [1, 2] and second.generations == [2, 1]
        with pytest.raises(ValueError, match="2 keys for 3 prompts"):
            engine.generate(prompts(tok, 3), 1, params, seed=1, affinity=[0, 1])
        engine.close()
    finally:
        second.close()


def test_lora_adapters_to_gspo_serve_are_refused_with_the_fix_and_merged_weights_go(served, tmp_path):
    import dataclasses

    from gspo_lightning.errors import ConfigError
    from gspo_lightning.models.lora import LoRA

    _, _, spec = policy_and_spec()
    spec = dataclasses.replace(spec, lora=LoRA(rank=4, alpha=8))
    engine = StockVLLMEngine(base_urls=[served.url], api_key_env="GSPO_SERVER_TOKEN", weights_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="lora_sync: merged"):
        engine.start(spec)
    engine.close()
    merged = StockVLLMEngine(base_urls=[served.url], api_key_env="GSPO_SERVER_TOKEN", weights_dir=str(tmp_path),
                             lora_sync="merged")
    merged.start(spec)
    assert merged.weights_format == "full"
    merged.close()


def test_a_killed_runs_weights_folder_is_removed_by_the_next_run(served, tmp_path):
    """The engine's folder names its process; a folder of a process that is gone (a trainer
    killed outright: its weights copy sits in /dev/shm) goes at the next start, a live one stays."""
    _, _, spec = policy_and_spec()
    dead = tmp_path / "gspo-weights-999999999-abc"  # no such pid
    live = tmp_path / f"gspo-weights-{os.getppid()}-abc"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    engine = engine_on([served.url], spec, tmp_path)
    assert not dead.exists() and live.exists()
    mine = [f for f in tmp_path.iterdir() if f.name.startswith(f"gspo-weights-{os.getpid()}-")]
    assert len(mine) == 1
    engine.close()
    assert not mine[0].exists()


def test_every_rank_samples_from_the_adapter_rank_0_loaded():
    """Rank 0 alone loads a LoRA version on the servers; the name its generations use reaches the
    other ranks with the reload's outcome (else they would sample from the base)."""

    class RankZeroSaid:  # rank 0's side of the broadcast, as torch.distributed delivers it
        def setup(self, world_size):
            pass

        def share(self, value):
            return ({"bytes": 8.0, "tensors": 2.0, "write_seconds": 0.0}, "policy-v3", None)

    engine = StockVLLMEngine(base_urls=["http://127.0.0.1:9"])
    engine.model, engine.rank, engine._ranks = "m", 1, RankZeroSaid()
    report = engine.update_weights(iter([]), 3)
    assert engine._adapter == "policy-v3" and engine.weights_version == 3 and report["tensors"] == 2.0


# -- vllm-router in front of the replicas ---------------------------------------------------------------
@pytest.fixture
def routed(tmp_path):
    """Two gspo serve replicas behind a real vllm-router (consistent hashing by X-Session-ID) on
    127.0.0.1; skipped without the package (`pip install vllm-router`; CI installs it)."""
    import shutil
    import subprocess
    import sys

    from tests.helpers_server import free_port

    beside = Path(sys.executable).parent / "vllm-router"  # this environment's, when it is not on PATH
    router = str(beside) if beside.exists() else shutil.which("vllm-router")
    if router is None:
        pytest.skip("vllm-router is not installed (pip install -e '.[router]')")
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    replicas = [Served(root, limits=ServerLimits()), Served(root, limits=ServerLimits())]
    port = free_port()
    log = open(tmp_path / "router.log", "w")
    # docs/scaling.md's command as written, on free ports
    import re
    import shlex

    block = re.search(r"### A router in front: `vllm-router`\n.*?```bash\n(.*?)```", (ROOT / "docs/scaling.md").read_text(),
                      re.S).group(1)
    command = shlex.split(block[:block.index("gspo fit")].replace("\\\n", " "))
    assert command[0] == "vllm-router" and command[command.index("--host") + 1] == "127.0.0.1"
    workers = command.index("--worker-urls")
    command = [router, *command[1:workers], "--worker-urls", *[r.url for r in replicas]]
    command[command.index("--port") + 1] = str(port)
    command += ["--prometheus-port", str(free_port())]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert process.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
                time.sleep(0.25)
        yield url, replicas, tmp_path / "router.log"
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
        for replica in replicas:
            replica.close()


def test_through_vllm_router_each_key_stays_on_one_replica(routed, tmp_path):
    """router_url: generations go through the router, a key's prompts in one request with its
    X-Session-ID, so consistent hashing keeps each key on one replica call after call; the
    samples come back in the prompts' order with the policy's log-probs."""
    url, replicas, router_log = routed
    policy, tok, spec = policy_and_spec(seed=2)
    engine = StockVLLMEngine(base_urls=[r.url for r in replicas], router_url=url, api_key_env="GSPO_SERVER_TOKEN",
                             weights_dir=replicas[0].app.weights_root)
    engine.start(spec)
    engine.update_weights(iter_policy_weights(policy), 1)
    assert [len(r.loads) for r in replicas] == [1, 1]  # control calls reach every replica, not the router
    # keys 0..5 with 1..6 prompts each: a replica's request sizes name the keys it served
    keys = [k for k in range(6) for _ in range(k + 1)]
    asked = [tok(f"next {k}", add_special_tokens=False)["input_ids"] for k in keys]
    served_keys = []
    for call in range(3):
        before = [len(r.generations) for r in replicas]
        generation = engine.generate(asked, 2, SamplingParams(max_new_tokens=4), seed=call, affinity=keys)
        got = [sorted(r.generations[b:]) for r, b in zip(replicas, before)]
        assert sorted(got[0] + got[1]) == [1, 2, 3, 4, 5, 6]  # one request per key
        served_keys.append(got)
        row = 2 * keys.index(3)  # the first sample of key 3's first prompt
        length = int(generation.lengths[row])
        completion = generation.completion_ids[row, :length].tolist()
        expected = logprobs_under(policy, asked[row // 2], completion)
        assert float((generation.logprobs[row, :length] - expected).abs().max()) < 1e-5
    assert served_keys[0] == served_keys[1] == served_keys[2]  # sticky: the same replica for a key every call
    engine.close()
    # the router placed each request by the engine's session id (without it: by the body's shape)
    import re

    routed_to = re.findall(r"Consistent hash routing: key='([^']*)' -> worker='([^']*)'", router_log.read_text())
    assert len(routed_to) == 3 * 6 and {key for key, _ in routed_to} == {f"header:x-session-id:{engine._session_tag}-{k}"
                                                                           for k in range(6)}
    worker_of = dict(routed_to)
    assert routed_to == [(key, worker_of[key]) for key, _ in routed_to]  # one replica per session
    for replica, sizes in zip(replicas, served_keys[0]):  # and the replicas saw what the router says it sent them
        assert sizes == sorted(int(key.rpartition("-")[2]) + 1 for key, worker in worker_of.items() if worker == replica.url)


def test_the_quickstart_learns_through_vllm_router_with_every_replica_reloaded(routed, tmp_path, monkeypatch):
    """The quickstart for 4 steps with router_url: every replica reloads every update (control calls
    go to each of base_urls), the samples come through the router, and the trainer scores them as
    the engines did (the engine-vs-trainer gap at float32 level: no replica sampled stale weights)."""
    from gspo_lightning.cli import main

    url, replicas, _ = routed
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    main(["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.max_steps=4",
          "--trainer.val_check_interval=1000", "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
          "--model.export_on_fit_end=false", "--trainer.enable_checkpointing=false", "--export=last", "--seed_everything=3",
          f"--trainer.default_root_dir={tmp_path / 'run'}", "--model.objective.old_logprobs=engine",
          "--model.engine.class_path=gspo_lightning.rollout.StockVLLMEngine",
          f"--model.engine.init_args.base_urls=[{replicas[0].url},{replicas[1].url}]",
          f"--model.engine.init_args.router_url={url}", "--model.engine.init_args.api_key_env=GSPO_SERVER_TOKEN",
          f"--model.engine.init_args.weights_dir={replicas[0].app.weights_root}"])
    rows = metric_rows(tmp_path / "run")
    assert len(rows) == 4
    assert max(float(r["engine/logprob_abs_diff"]) for r in rows.values()) < 1e-4
    assert [len(r.loads) for r in replicas] == [4, 4]
    assert sum(len(r.generations) for r in replicas) == 4 * 16  # a request per prompt group, 16 a step


def test_router_url_is_checked_before_a_run_starts():
    with pytest.raises(Exception, match="router_url must be an http"):
        StockVLLMEngine(base_urls=["http://127.0.0.1:1"], router_url="127.0.0.1:2")
    with pytest.raises(Exception, match="leave router_url unset"):
        StockVLLMEngine(launch=1, router_url="http://127.0.0.1:2")
