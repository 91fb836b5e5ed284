"""The engine contract, run against the Hugging Face engine (the vLLM engine runs the same
checks where CUDA and vLLM exist), and the exactness of its sampler."""

import math

import pytest
import torch
import torch.nn.functional as F

from gspo_lightning.training.logprobs import response_logprobs
from gspo_lightning.rollout.engine import EngineSpec, SamplingParams
from gspo_lightning.rollout.hf import HFEngine, _sample_step, left_pad
from gspo_lightning.rollout.sampling import filter_logits
from tests.helpers_engine import make_engine, prompts, rollout_batch


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


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 50, 1.0), (0.7, 0, 0.9), (1.3, 40, 0.8),
])
def test_logprobs_match_a_recomputation_by_the_policy(tiny_gsm8k, temperature, top_k, top_p):
    """The importance ratio compares the same distribution on both sides: the trainer's
    recomputation under the engine's sampling settings gives the engine's log-probs."""
    engine, tok = make_engine(tiny_gsm8k)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p)
    gen, full, attn, width = rollout_batch(engine, tok, prompts(tok), 3, params, seed=5)
    with torch.no_grad():
        recomputed, _ = response_logprobs(engine.model, full, attn, width, temperature=temperature,
                                          top_k=top_k, top_p=top_p)
    torch.testing.assert_close(recomputed[gen.mask], gen.logprobs[gen.mask], atol=2e-6, rtol=1e-6)


def test_filtered_logprobs_are_those_of_the_renormalized_kept_set_by_hand(tiny_echo):
    """top-k 3 at temperature 0.5: the engine reports log(p_t / sum of the 3 largest p)."""
    engine, tok = make_engine(tiny_echo)
    ps = [tok("repeat 1 2", add_special_tokens=False)["input_ids"]]
    gen = engine.generate(ps, 4, SamplingParams(max_new_tokens=3, temperature=0.5, top_k=3), seed=1)
    for row in range(4):
        ids = torch.tensor([ps[0] + gen.completion_ids[row, :3].tolist()])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(ps[0]) - 1:-1]  # predicts the 3 response tokens
        for step in range(3):
            probs = torch.softmax(logits[step].double() / 0.5, -1)
            top3 = probs.topk(3).indices.tolist()
            token = int(gen.completion_ids[row, step])
            assert token in top3
            expected = math.log(probs[token] / probs[top3].sum())
            assert abs(float(gen.logprobs[row, step]) - expected) < 1e-5


def test_generation_batch_size_is_only_a_memory_knob(tiny_gsm8k):
    # chunks of 5 responses hold one whole group of 4: greedy results, row order (response j
    # answers prompt j // n) and log-probs equal those of one batch
    whole, tok = make_engine(tiny_gsm8k)
    chunked, _ = make_engine(tiny_gsm8k, generation_batch_size=5)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    a = whole.generate(prompts(tok), 4, greedy, seed=0)
    b = chunked.generate(prompts(tok), 4, greedy, seed=0)
    assert b.completion_ids.shape[0] == 12
    assert torch.equal(a.lengths, b.lengths) and torch.equal(a.truncated, b.truncated)
    width = int(a.lengths.max())
    assert torch.equal(a.completion_ids[:, :width], b.completion_ids[:, :width])
    torch.testing.assert_close(a.logprobs[:, :width], b.logprobs[:, :width], atol=1e-5, rtol=1e-5)
    # different prompts give different greedy answers here, so a row-order mix-up would show
    assert not torch.equal(a.completion_ids[0], a.completion_ids[4])


def test_greedy_is_deterministic_and_picks_argmax(tiny_gsm8k):
    engine, tok = make_engine(tiny_gsm8k)
    ps = prompts(tok, 1)
    gen = engine.generate(ps, 2, SamplingParams(max_new_tokens=3, temperature=0.0), seed=0)
    assert torch.equal(gen.completion_ids[0], gen.completion_ids[1])
    logits = engine.model(input_ids=torch.tensor(ps)).logits[0, -1]
    assert gen.completion_ids[0, 0] == logits.argmax()


def test_sampled_frequencies_match_a_known_distribution():
    """20000 draws from fixed probabilities (top-k / top-p off and on): every frequency
    within 4.5 standard deviations of its probability under the renormalized kept set."""
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.03, 0.02, 0.01])
    logits = probs.log().expand(20000, -1).contiguous()
    generator = torch.Generator().manual_seed(0)
    for top_k, top_p, kept in [(0, 1.0, 10), (4, 1.0, 4), (0, 0.7, 4), (6, 0.85, 5)]:
        token, logprob = _sample_step(logits, SamplingParams(4, top_k=top_k, top_p=top_p), generator)
        target = torch.zeros(10, dtype=torch.float64)
        target[:kept] = probs[:kept].double() / probs[:kept].double().sum()
        freq = torch.bincount(token, minlength=10).double() / len(token)
        sd = (target * (1 - target) / len(token)).sqrt()
        assert ((freq - target).abs() <= 4.5 * sd + 1e-12).all(), (top_k, top_p, freq, target)
        torch.testing.assert_close(logprob.double(), target[token].log(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("vocab", [1500, 4096])
def test_two_level_draw_matches_a_known_distribution(vocab):
    """Vocabularies past one level (blocks of ~sqrt(vocab) entries; 1500 pads its last block):
    heavy tokens at block edges, the last entry and the rest spread thin are each drawn at
    their probability, and no padding index is ever returned."""
    width = 1 << math.ceil(math.log2(vocab) / 2)
    heavy = [0, width - 1, width, 5 * width + 7, vocab - 1]
    probs = torch.full((vocab,), 0.3 / (vocab - len(heavy)), dtype=torch.float64)
    probs[heavy] = torch.tensor([0.2, 0.1, 0.15, 0.05, 0.2], dtype=torch.float64)
    logits = probs.log().float().expand(20000, -1).contiguous()
    token, logprob = _sample_step(logits, SamplingParams(4), torch.Generator().manual_seed(0))
    assert int(token.max()) < vocab
    freq = torch.bincount(token, minlength=vocab).double() / len(token)
    observed = torch.cat([freq[heavy], (1 - freq[heavy].sum())[None]])
    target = torch.cat([probs[heavy], torch.tensor([0.3], dtype=torch.float64)])
    sd = (target * (1 - target) / len(token)).sqrt()
    assert ((observed - target).abs() <= 4.5 * sd).all(), (observed, target)
    torch.testing.assert_close(logprob.double(), probs[token].log(), atol=1e-5, rtol=0)


@pytest.mark.slow  # ~5 s: detecting a 1% mass needs ~1e9 vocabulary entries drawn over
def test_tokens_below_float32_cdf_resolution_are_sampled():
    """A 2**20-token tail of tiny probabilities (1.8e-8 each) after a token holding 98%.

    A float32 cumulative sum cannot tell most tail tokens apart from their neighbour: their
    CDF steps round to zero width (the tokens of ``lost``, 1.3% of the mass), and a float32
    inverse-CDF draw never returns them. An exact draw returns them at their probability.
    """
    tail = 2**20
    logits = torch.full((tail + 1,), math.log(1.8e-8))
    logits[0] = 0.0
    probs = F.log_softmax(logits, -1).exp()
    cdf32 = probs.cumsum(-1)
    lost = (torch.diff(cdf32, prepend=cdf32.new_zeros(1)) == 0) & (probs > 0)
    lost_mass = float(probs.double()[lost].sum())
    assert 0.01 < lost_mass < 0.02
    rows = logits.expand(16, -1).contiguous()
    generator = torch.Generator().manual_seed(0)
    draws = hits = 0
    for _ in range(48):
        token, _ = _sample_step(rows, SamplingParams(4), generator)
        hits += int(lost[token].sum())
        draws += len(token)
    expected = draws * lost_mass  # ~10.3: P(hits == 0) = 3e-5, P(hits > 25) = 1e-4 for an exact sampler
    assert 1 <= hits <= 25, (hits, expected)


def test_filter_logits_top_k_and_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [[True, True, False, False]]
    # nucleus 0.7: 0.5 alone is below 0.7, 0.5 + 0.3 reaches it -> keep two
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.85))
    assert kept.tolist() == [[True, True, True, False]]


def naive_kept(row: list[float], top_k: int, top_p: float) -> set[int]:
    """Top-k then top-p by hand, on one row of logits: the k largest (with ties of the k-th),
    renormalized over what is left, then the shortest prefix, by falling probability, whose
    mass reaches top_p."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    kept = order
    if 0 < top_k < len(row):
        kth = row[order[top_k - 1]]
        kept = [i for i in order if row[i] >= kth]
    if top_p < 1.0:
        total = sum(math.exp(row[i]) for i in kept)
        nucleus, mass = [], 0.0
        for i in kept:
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += math.exp(row[i]) / total
        kept = nucleus
    return set(kept)


def kept_set(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    return set(torch.isfinite(filter_logits(logits, top_k=top_k, top_p=top_p)).nonzero().flatten().tolist())


def test_top_k_then_top_p_by_hand():
    # probabilities 0.4 0.25 0.2 0.1 0.05; top-k 3 leaves 0.4 0.25 0.2, renormalized 0.47 0.29
    # 0.24: the nucleus 0.7 needs two of them. On the full distribution it would need three
    # (0.4 + 0.25 < 0.7): top-p acts on what top-k left, as in transformers and vLLM.
    logits = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05]).log()
    assert naive_kept(logits.tolist(), 3, 0.7) == kept_set(logits, 3, 0.7) == {0, 1}
    assert naive_kept(logits.tolist(), 0, 0.7) == kept_set(logits, 0, 0.7) == {0, 1, 2}
    assert kept_set(logits, 3, 0.99) == {0, 1, 2} and kept_set(logits, 0, 0.3) == {0}  # the first always stays
    # ties with the k-th logit stay
    tied = torch.tensor([1.0, 2.0, 2.0, 0.0])
    assert naive_kept(tied.tolist(), 1, 1.0) == kept_set(tied, 1, 1.0) == {1, 2}
    assert kept_set(tied, 3, 1.0) == {0, 1, 2}


def test_filter_matches_a_naive_top_k_top_p_on_random_logits():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(200, 12, generator=generator, dtype=torch.float64) * 2
    for top_k, top_p in [(0, 0.5), (0, 0.9), (4, 1.0), (4, 0.6), (7, 0.95), (1, 0.3), (12, 0.8)]:
        rows = filter_logits(logits, top_k=top_k, top_p=top_p)
        for row, filtered in zip(logits, rows):
            got = set(torch.isfinite(filtered).nonzero().flatten().tolist())
            assert got == naive_kept(row.tolist(), top_k, top_p), (top_k, top_p, row)


def test_sampling_params_reject_bad_values():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(4, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(0)


def test_samples_the_policy_itself_so_weights_are_never_pushed(tiny_echo):
    engine, _ = make_engine(tiny_echo)
    assert engine.shares_policy_weights and engine.model is tiny_echo[0]
    with pytest.raises(ValueError, match="policy"):
        HFEngine().start(EngineSpec(model_name_or_path="builtin:test", dtype="float32", prompt_length=None,
                                    response_length=4, seed=0, eos_token_ids=[1], pad_token_id=0))


def test_results_are_ordinary_tensors_and_hooked_models_decode_under_no_grad(tiny_gsm8k):
    """Plain models decode under inference_mode (leaner), but the results must be ordinary
    tensors: the trainer saves tokens for backward and edits them in place. Hooks (ZeRO-3
    gathering, MoE routing records) keep tensors they create, so hooked models use no_grad."""
    engine, tok = make_engine(tiny_gsm8k)
    model = tiny_gsm8k[0]
    seen = []
    plain = engine.generate(prompts(tok), 2, SamplingParams(max_new_tokens=6), seed=5)
    for t in (plain.completion_ids, plain.logprobs, plain.lengths, plain.truncated):
        assert not t.is_inference()
    plain_logprobs = plain.logprobs.clone()
    plain.completion_ids[0, 0] = tok.pad_token_id  # in place: an inference tensor would raise here
    weight = torch.randn(plain.logprobs.shape, requires_grad=True)
    (weight * plain.logprobs).sum().backward()  # saved for backward: likewise
    handle = model.get_decoder().layers[0].register_forward_hook(
        lambda module, args, output: seen.append(torch.is_inference_mode_enabled()))
    try:
        hooked = engine.generate(prompts(tok), 2, SamplingParams(max_new_tokens=6), seed=5)
    finally:
        handle.remove()
    assert seen and not any(seen)
    # same samples either way (the hooked layer takes the unfused decode path: rounding differs)
    assert torch.allclose(hooked.logprobs, plain_logprobs, atol=1e-5)
    assert not plain.logprobs.requires_grad and not hooked.logprobs.requires_grad


def test_generation_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="generation_batch_size"):
        HFEngine(generation_batch_size=0)


def _tiny_lm(model_type, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  pad_token_id=0, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("llama", {"attention_bias": True}), ("qwen2", {}),
                                              ("qwen3", {}), ("mistral", {})])
def test_kv_decoder_reproduces_the_model_forward(model_type, extra, fuse, monkeypatch):
    """Decode steps over the preallocated cache, with fused weights (small models: q|k|v and
    gate|up concatenated, norm weights folded in) or the model's own projections, give the
    logits of a full forward over [left-padded prompt | fed tokens], for every row (repeated
    prompts, GQA, left padding, biases on every attention projection)."""
    from gspo_lightning.rollout import kv_decode

    monkeypatch.setattr(kv_decode, "_FUSE_MAX_BYTES", 2**40 if fuse else 0)
    model = _tiny_lm(model_type, **extra)
    with torch.no_grad():  # norm weights away from 1, so that folding them in is tested
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    assert kv_decode.supports(model)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    ids, mask = left_pad(prompts, 0, "cpu")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    repeat, feeds = 2, 5
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        decoder = kv_decode.KVDecoder(model, out.past_key_values, mask, repeat, feeds)
        assert (decoder.fused is not None) == fuse and all(layer is not None for layer in decoder.fused or [])
        fed = torch.randint(3, 50, (len(prompts) * repeat, feeds), generator=torch.Generator().manual_seed(0))
        full_ids = torch.cat([ids.repeat_interleave(repeat, 0), fed], 1)
        full_mask = torch.cat([mask.repeat_interleave(repeat, 0), torch.ones_like(fed)], 1)
        full_positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        for step in range(feeds):
            logits = decoder.step(fed[:, step])
            width = ids.shape[1] + step + 1
            expected = model(input_ids=full_ids[:, :width], attention_mask=full_mask[:, :width],
                             position_ids=full_positions[:, :width]).logits[:, -1]
            torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
        with pytest.raises(RuntimeError, match="more tokens"):
            decoder.step(fed[:, 0])


def test_kv_decoder_declines_models_it_does_not_reproduce():
    from gspo_lightning.rollout import kv_decode

    assert not kv_decode.supports(_tiny_lm("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0))
    assert not kv_decode.supports(_tiny_lm("gpt2"))


def test_kv_decoder_declines_fsdp2_sharded_policies():
    """FSDP2 gathers weights in each wrapped module's forward: the decoder must not call
    submodules of a sharded policy directly (the engine falls back to the model's forward)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gspo_lightning.rollout import kv_decode

    model = _tiny_lm("qwen2")
    assert kv_decode.supports(model)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert not kv_decode.supports(model)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_sampling_params_refuse_a_temperature_that_is_not_a_finite_number_at_least_0(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(4, temperature=temperature)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(4, top_p=float("nan"))
