"""The engine contract, run against the Hugging Face engine (the vLLM engine runs the same
checks where CUDA and vLLM exist)."""

import pytest
import torch

from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.rollout.engine import SamplingParams
from gspo_lightning.rollout.hf import HFEngine, filter_logits, left_pad


def make_engine(model_tok):
    model, tok = model_tok
    return HFEngine(model, [tok.eos_token_id], tok.pad_token_id), tok


def prompts(tok, n=3):
    texts = ["Natalia sold clips", "How many", "A farmer has 12 cows and"][:n]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_shapes_lengths_and_finish_reasons(tiny_gsm8k):
    engine, tok = make_engine(tiny_gsm8k)
    gen = engine.generate(prompts(tok), 4, SamplingParams(max_new_tokens=10), seed=0)
    assert gen.completion_ids.shape[0] == 12 and gen.completion_ids.shape[1] <= 10
    assert gen.logprobs.shape == gen.completion_ids.shape
    for row, length, truncated in zip(gen.completion_ids, gen.lengths, gen.truncated):
        has_eos = bool((row[:length] == tok.eos_token_id).any())
        assert truncated == (not has_eos)
        if has_eos:  # the end-of-sequence token is the last counted token
            assert row[length - 1] == tok.eos_token_id
        else:
            assert length == 10
    assert (gen.logprobs[~gen.mask] == 0).all() and (gen.logprobs[gen.mask] <= 0).all()


def test_same_seed_same_samples_other_seed_differs(tiny_gsm8k):
    engine, tok = make_engine(tiny_gsm8k)
    params = SamplingParams(max_new_tokens=8)
    a = engine.generate(prompts(tok), 4, params, seed=123)
    b = engine.generate(prompts(tok), 4, params, seed=123)
    c = engine.generate(prompts(tok), 4, params, seed=124)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_recomputation_by_the_policy(tiny_gsm8k, temperature):
    engine, tok = make_engine(tiny_gsm8k)
    ps = prompts(tok)
    gen = engine.generate(ps, 3, SamplingParams(max_new_tokens=12, temperature=temperature, top_k=50), seed=5)
    ids, mask = left_pad([p for p in ps for _ in range(3)], tok.pad_token_id, "cpu")
    full = torch.cat([ids, gen.completion_ids], 1)
    attn = torch.cat([mask, gen.mask.long()], 1)
    recomputed, _ = response_logprobs(engine.model, full, attn, ids.shape[1], temperature=temperature)
    torch.testing.assert_close(recomputed[gen.mask], gen.logprobs[gen.mask], atol=1e-5, rtol=1e-5)


def test_generation_batch_size_does_not_change_samples_shape(tiny_gsm8k):
    model, tok = tiny_gsm8k
    chunked = HFEngine(model, [tok.eos_token_id], tok.pad_token_id, generation_batch_size=5)
    gen = chunked.generate(prompts(tok), 4, SamplingParams(max_new_tokens=6), seed=0)
    assert gen.completion_ids.shape[0] == 12 and gen.lengths.shape == (12,)


def test_greedy_is_deterministic_and_picks_argmax(tiny_gsm8k):
    engine, tok = make_engine(tiny_gsm8k)
    ps = prompts(tok, 1)
    gen = engine.generate(ps, 2, SamplingParams(max_new_tokens=3, temperature=0.0), seed=0)
    assert torch.equal(gen.completion_ids[0], gen.completion_ids[1])
    logits = engine.model(input_ids=torch.tensor(ps)).logits[0, -1]
    assert gen.completion_ids[0, 0] == logits.argmax()


def test_filter_logits_top_k_and_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [[True, True, False, False]]
    # nucleus 0.7: 0.5 alone is below 0.7, 0.5 + 0.3 reaches it -> keep two
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.85))
    assert kept.tolist() == [[True, True, True, False]]


def test_sampling_params_reject_bad_values():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(4, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(0)


def test_update_weights_skips_unchanged_version(tiny_echo):
    engine, _ = make_engine(tiny_echo)
    assert engine.update_weights(engine.model, 0) is not None
    assert engine.update_weights(engine.model, 0) is None
    assert engine.update_weights(engine.model, 1) is not None and engine.weights_version == 1
