"""The engine contract of tests/test_engine.py, run against the vLLM engine.

Needs an NVIDIA GPU and vLLM 0.32 (``pip install 'gspo-lightning[vllm]'``); skipped
otherwise. vLLM allows one engine per process, so every test shares one engine (built
with sleep mode, so each rollout also exercises sleep / wake and the weight wake-up):
run this file in its own pytest process when another test file builds a vLLM engine.
"""

import copy
from types import SimpleNamespace

import pytest
import torch

from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.rollout.engine import RolloutEngine, SamplingParams
from gspo_lightning.rollout.hf import left_pad

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

if not torch.cuda.is_available():
    pytest.skip("the vLLM engine needs CUDA (torch.cuda.is_available() is False)", allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'gspo-lightning[vllm]' on a CUDA machine")

from gspo_lightning.rollout.vllm import VLLMEngine  # noqa: E402

MAX_NEW = 12


@pytest.fixture(scope="module")
def setup(tiny_gsm8k):
    cpu_model, tok = tiny_gsm8k
    model = copy.deepcopy(cpu_model).cuda().eval()
    hparams = SimpleNamespace(
        model_name_or_path="builtin:tiny-gsm8k", dtype="float32", temperature=1.0, top_k=0, top_p=1.0,
        response_length=MAX_NEW, rollout_seed=0, trust_remote_code=False,
    )
    module = SimpleNamespace(hparams=hparams, policy=model, tokenizer=tok)  # what from_module reads
    engine = VLLMEngine.from_module(
        module, [tok.eos_token_id], gpu_memory_utilization=0.2, max_model_len=128, sleep_level=1,
        weight_sync_bucket_mb=0.05, enforce_eager=True,
    )
    stats = engine.update_weights(model, 0)  # builtin models start from dummy weights
    assert stats is not None and stats["buckets"] > 1
    return engine, model, tok


def prompts(tok, n=3):
    texts = ["Natalia sold clips", "How many", "A farmer has 12 cows and"][:n]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def roll(engine, ps, n, params, seed):
    """As the rollout callback does: wake, generate, sleep."""
    engine.wake()
    try:
        return engine.generate(ps, n, params, seed)
    finally:
        engine.sleep()


def test_is_a_rollout_engine(setup):
    engine, _, _ = setup
    assert isinstance(engine, RolloutEngine) and engine.weights_version == 0


def test_shapes_lengths_and_finish_reasons(setup):
    engine, _, tok = setup
    gen = roll(engine, prompts(tok), 4, SamplingParams(max_new_tokens=10), seed=0)
    assert gen.completion_ids.shape[0] == 12 and gen.completion_ids.shape[1] <= 10
    assert gen.logprobs.shape == gen.completion_ids.shape
    for row, length, truncated in zip(gen.completion_ids, gen.lengths, gen.truncated):
        has_eos = bool((row[:length] == tok.eos_token_id).any())
        assert truncated == (not has_eos)
        if has_eos:
            assert row[length - 1] == tok.eos_token_id
        else:
            assert length == 10
    assert (gen.logprobs[~gen.mask] == 0).all() and (gen.logprobs[gen.mask] <= 0).all()


def test_same_seed_same_samples_other_seed_differs(setup):
    engine, _, tok = setup
    params = SamplingParams(max_new_tokens=8)
    a = roll(engine, prompts(tok), 4, params, seed=123)
    b = roll(engine, prompts(tok), 4, params, seed=123)
    c = roll(engine, prompts(tok), 4, params, seed=124)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_recomputation_by_the_policy(setup, temperature):
    # no top-k / top-p: vLLM's processed_logprobs are then exactly log_softmax(logits / T)
    engine, model, tok = setup
    ps = prompts(tok)
    gen = roll(engine, ps, 3, SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature), seed=5)
    ids, mask = left_pad([p for p in ps for _ in range(3)], tok.pad_token_id, "cuda")
    full = torch.cat([ids, gen.completion_ids.cuda()], 1)
    attn = torch.cat([mask, gen.mask.long().cuda()], 1)
    with torch.no_grad():
        recomputed, _ = response_logprobs(model, full, attn, ids.shape[1], temperature=temperature)
    # different kernels (vLLM's attention vs. eager / sdpa): close, not bit-equal
    torch.testing.assert_close(recomputed[gen.mask.cuda()].cpu(), gen.logprobs[gen.mask], atol=2e-3, rtol=1e-3)


def test_greedy_is_deterministic_and_picks_argmax(setup):
    engine, model, tok = setup
    ps = prompts(tok, 1)
    gen = roll(engine, ps, 2, SamplingParams(max_new_tokens=3, temperature=0.0), seed=0)
    assert torch.equal(gen.completion_ids[0], gen.completion_ids[1])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ps, device="cuda")).logits[0, -1]
    assert gen.completion_ids[0, 0] == logits.argmax().cpu()


def test_update_weights_skips_unchanged_version_and_loads_new_weights(setup):
    engine, model, tok = setup
    assert engine.update_weights(model, 0) is None
    ps = prompts(tok, 1)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        with torch.no_grad():  # a different policy: the engine must follow it after a sync
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        stats = engine.update_weights(model, 1)
        assert stats is not None and stats["bytes"] > 0 and engine.weights_version == 1
        gen = roll(engine, ps, 1, SamplingParams(max_new_tokens=1, temperature=0.0), seed=0)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(ps, device="cuda")).logits[0, -1]
        assert gen.completion_ids[0, 0] == logits.argmax().cpu()
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
        engine.update_weights(model, 2)
