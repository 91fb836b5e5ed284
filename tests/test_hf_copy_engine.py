"""HFCopyEngine: a lower-precision copy of the policy, weights pushed once per version,
log-probs a measured small distance from the float32 trainer's."""

from __future__ import annotations

import warnings

import pytest
import torch

from gspo_lightning.training.logprobs import response_logprobs
from gspo_lightning.rollout import EngineSpec, HFCopyEngine, RolloutWorker, SamplingParams
from gspo_lightning.rollout.hf import left_pad
from gspo_lightning.rollout.hf_copy import fp8_round
from gspo_lightning.rollout.weight_sync import iter_policy_weights
from tests.helpers import CountingTransport

MAX_NEW = 12


def peaked_policy():
    """tiny-echo with weights redrawn so that distributions are peaked (a near-uniform model
    would hide precision errors)."""
    from gspo_lightning.data.tasks import build_tiny

    torch.manual_seed(0)
    policy, tok = build_tiny("builtin:tiny-echo")
    with torch.no_grad():
        for p in policy.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
        policy.get_input_embeddings().weight[tok.eos_token_id] *= 0.5
    return policy.eval(), tok


def start(engine, policy, tok):
    engine.start(EngineSpec(
        model_name_or_path="builtin:tiny-echo", dtype="float32", prompt_length=8, response_length=MAX_NEW, seed=0,
        eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=policy, tokenizer=tok,
    ))
    return engine


def prompts(tok):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in ("repeat 1 2", "repeat 9", "repeat 4 0 4 7")]


def trainer_logprobs(policy, tok, ps, gen, n):
    ids, mask = left_pad([p for p in ps for _ in range(n)], tok.pad_token_id, "cpu")
    with torch.no_grad():
        return response_logprobs(policy, torch.cat([ids, gen.completion_ids], 1),
                                 torch.cat([mask, gen.mask.long()], 1), ids.shape[1])[0]


def mismatch(dtype, quantization=None):
    policy, tok = peaked_policy()
    engine = start(HFCopyEngine(dtype=dtype, weight_quantization=quantization), policy, tok)
    ps = prompts(tok)
    gen = engine.generate(ps, 8, SamplingParams(MAX_NEW), seed=3)
    diff = (trainer_logprobs(policy, tok, ps, gen, 8) - gen.logprobs)[gen.mask].abs()
    return diff, engine, policy


def test_the_copy_has_the_engine_dtype_and_the_policy_keeps_its_own():
    _, engine, policy = mismatch("bfloat16")
    assert engine.model is not policy
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in engine.model.parameters())
    assert HFCopyEngine.shares_policy_weights is False


def test_generation_shapes_and_reproducible_sampling():
    policy, tok = peaked_policy()
    engine = start(HFCopyEngine(dtype="bfloat16"), policy, tok)
    ps, params = prompts(tok), SamplingParams(MAX_NEW)
    a = engine.generate(ps, 4, params, seed=11)
    b = engine.generate(ps, 4, params, seed=11)
    assert a.completion_ids.shape[0] == 12 and a.completion_ids.shape[1] <= MAX_NEW
    assert a.logprobs.dtype == torch.float32 and (a.logprobs[a.mask] <= 0).all() and (a.logprobs[~a.mask] == 0).all()
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    greedy = engine.generate(ps, 1, SamplingParams(MAX_NEW, temperature=0.0), seed=0)
    assert greedy.completion_ids.shape[0] == 3


# Measured on this model (peaked weights, ~220 sampled tokens): mean |token log-prob diff|
# float32 8e-7, float16 4e-3, bfloat16 3e-2, bfloat16 + fp8 weights 2e-1 (max 8e-6, 3e-2,
# 0.3, 1.2). The bounds leave about a factor of 5 on both sides.
@pytest.mark.parametrize("dtype, quantization, low, high", [
    ("float32", None, 0.0, 1e-5),
    ("float16", None, 8e-4, 2e-2),
    ("bfloat16", None, 6e-3, 0.15),
    ("bfloat16", "fp8", 4e-2, 1.0),
])
def test_logprobs_differ_from_the_float32_trainer_by_a_small_measured_amount(dtype, quantization, low, high):
    diff, _, _ = mismatch(dtype, quantization)
    assert low <= float(diff.mean()) <= high, float(diff.mean())
    assert float(diff.max()) < 10 * high


def test_precision_orders_the_mismatch():
    means = [float(mismatch(d, q)[0].mean()) for d, q in
             (("float32", None), ("float16", None), ("bfloat16", None), ("bfloat16", "fp8"))]
    assert means == sorted(means) and means[0] < means[1] / 10


def test_weights_pushed_once_per_version_and_only_then_used():
    policy, tok = peaked_policy()
    engine = start(HFCopyEngine(dtype="bfloat16"), policy, tok)
    transport = CountingTransport()
    params = SamplingParams(MAX_NEW)
    worker = RolloutWorker(engine, None, tok, train_params=params, group_size=2, eval_params=params,
                           eval_group_size=1, transport=transport)
    worker.started = True
    push = lambda version: worker.sync_weights(version, lambda: iter_policy_weights(policy, bucket_bytes=4096))  # noqa: E731

    stats = push(0)  # the engine starts at version -1: the first rollout pushes
    assert transport.sends == 1 and engine.pushes == 1 and engine.weights_version == 0
    assert stats["weight_sync/bytes"] == sum(p.numel() * 4 for p in policy.parameters())  # float32 sent, tied head once
    assert push(0) == {} and transport.sends == 1

    ps, greedy = prompts(tok), SamplingParams(MAX_NEW, temperature=0.0)
    before = engine.generate(ps, 1, greedy, seed=0)
    # one optimizer step towards responses the policy does not give greedily
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.05)
    target = torch.full((3, MAX_NEW), tok.convert_tokens_to_ids("7"))
    ids, mask = left_pad(ps, tok.pad_token_id, "cpu")
    policy.train()
    logprobs, _ = response_logprobs(policy, torch.cat([ids, target], 1), torch.cat([mask, torch.ones_like(target)], 1),
                                    ids.shape[1])
    (-logprobs.mean()).backward()
    optimizer.step()
    policy.eval()

    # not pushed yet: the copy still samples the old weights
    assert torch.equal(engine.generate(ps, 1, greedy, seed=0).completion_ids, before.completion_ids)
    push(1)
    assert transport.sends == 2 and engine.pushes == 2 and engine.weights_version == 1
    assert push(1) == {} and transport.sends == 2
    after = engine.generate(ps, 1, greedy, seed=0)
    assert not torch.equal(after.completion_ids, before.completion_ids)
    # every weight (the tied output head too) reached the copy, up to bfloat16 rounding
    copy = dict(engine.model.named_parameters())
    for name, p in policy.named_parameters():
        assert torch.equal(copy[name], p.detach().to(torch.bfloat16)), name


def test_fp8_rounds_linear_layers_only():
    policy, tok = peaked_policy()
    engine = start(HFCopyEngine(dtype="bfloat16", weight_quantization="fp8"), policy, tok)
    copy = dict(engine.model.named_parameters())
    q = "model.layers.0.mlp.up_proj.weight"
    assert q in engine._quantized and torch.equal(copy[q], fp8_round(policy.get_parameter(q).detach().to(torch.bfloat16)))
    embed = "model.embed_tokens.weight"  # the embedding (and the tied output head) stays bfloat16
    assert embed not in engine._quantized
    assert torch.equal(copy[embed], policy.get_parameter(embed).detach().to(torch.bfloat16))
    w = torch.randn(4, 64)
    assert 0 < (fp8_round(w) - w).abs().max() <= w.abs().amax(-1).max() / 8  # 3 mantissa bits


def test_bad_knobs_and_unknown_weights_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        HFCopyEngine(dtype="int8")
    with pytest.raises(ValueError, match="weight_quantization"):
        HFCopyEngine(weight_quantization="int4")
    policy, tok = peaked_policy()
    engine = start(HFCopyEngine(), policy, tok)
    with pytest.raises(KeyError, match="nope"):
        engine.update_weights(iter([("nope", torch.zeros(1))]), 1)
    with pytest.raises(ValueError, match="sharded"):
        HFCopyEngine().start(EngineSpec(
            model_name_or_path="x", dtype="float32", prompt_length=8, response_length=4, seed=0, eos_token_ids=[1],
            pad_token_id=0, policy=policy, lockstep=lambda done: done))


def test_trains_with_engine_logprobs_as_old_and_logs_the_mismatch(tmp_path):
    import lightning as L

    from gspo_lightning.data.datamodule import PromptDataModule
    from gspo_lightning.training.module import GSPOModule
    from gspo_lightning.rewards import RewardSpec

    engine = HFCopyEngine(dtype="bfloat16")
    module = GSPOModule(
        model_name_or_path="builtin:tiny-echo", rewards=[RewardSpec(function="gspo_lightning.data.tasks.echo.echo_reward")],
        engine=engine, old_logprobs="engine", num_return_sequences_in_group=4, response_length=6,
        num_mini_batches=2, export_on_fit_end=False,
    )
    data = PromptDataModule(path="builtin:echo", tokenizer="builtin:tiny-echo", rollout_batch_size=4, prompt_length=8,
                            val_size=4)
    seen = []

    class Collect(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("engine/")})

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=[Collect()])
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first-mini-batch clip warning is expected here
        trainer.fit(module, datamodule=data)
    # one push per rollout: versions 0 and 2 (2 optimizer steps per rollout); the last update is not sampled yet
    assert engine.pushes == 2 and engine.weights_version == 2 and module.policy_version == 4
    assert len(seen) == 2 and all(0 < s["engine/logprob_abs_diff"] < 2e-2 for s in seen)


def test_a_bf16_copy_is_refused_on_a_cpu_without_bf16_units(tmp_path, monkeypatch):
    from gspo_lightning.rollout import hf_copy

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
    assert hf_copy.cpu_bf16_units(str(cpuinfo)) == []
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert hf_copy.cpu_bf16_units(str(cpuinfo)) == ["amx_bf16", "avx512_bf16"]
    assert hf_copy.cpu_bf16_units(str(tmp_path / "absent")) is None  # unknown (macOS): not refused
    policy, tok = peaked_policy()
    monkeypatch.setattr(hf_copy, "cpu_bf16_units", lambda: [])
    with pytest.raises(Exception, match="without bfloat16 units .* slower than float32"):
        start(HFCopyEngine(dtype="bfloat16"), policy, tok)
    start(HFCopyEngine(dtype="float16"), policy, tok)  # only bf16 needs the units


def test_a_vision_language_copy_samples_with_the_images():
    """The copy of a vision-language policy takes its images; in float32 (the exact control) its
    log-probs are the trainer's."""
    import random

    from gspo_lightning.data.tasks import build_tiny
    from gspo_lightning.data.tasks.colours import draw_square
    from gspo_lightning.models.tiny import build_image_processor, get_spec
    from gspo_lightning.models.vision import ImageRenderer
    from gspo_lightning.rollout.worker import build_rollout_tensors

    torch.manual_seed(2)
    policy, tok = build_tiny("builtin:tiny-vlm")
    engine = HFCopyEngine(dtype="float32")
    engine.start(EngineSpec(model_name_or_path="builtin:tiny-vlm", dtype="float32", prompt_length=16, response_length=6,
                            seed=0, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=policy))
    assert engine.takes_images and type(engine.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour"}]}],
                                   tokenize=False, add_generation_prompt=True)
    ids, images = ImageRenderer(tok, build_image_processor(get_spec("tiny-vlm"))).render(
        text, [draw_square("red", random.Random(1))])
    gen = engine.generate([ids], 8, SamplingParams(6), seed=4, images=[images])
    tensors = build_rollout_tensors([ids], gen, 8, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        ours = response_logprobs(policy, tensors["input_ids"], tensors["attention_mask"], tensors["prompt_width"],
                                 images=[images] * 8)[0]
    assert (ours - tensors["engine_logprobs"])[tensors["response_mask"]].abs().max() < 1e-5
