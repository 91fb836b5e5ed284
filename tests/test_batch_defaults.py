"""Defaults that do not scale with the batch: ``micro_batch_size: null`` holds at most 8192
tokens per forward, ``generation_batch_size: null`` a 4 GiB KV cache; small runs (the
quickstart, the benchmarks) keep one forward per mini-batch and one generation batch."""

import pytest
import torch

from gspo_lightning.training.module import GSPOModule
from gspo_lightning.rollout import hf
from gspo_lightning.rollout.engine import EngineSpec, SamplingParams
from gspo_lightning.rollout.hf import HFEngine
from gspo_lightning.rollout.kv_decode import kv_cache_bytes_per_token
from gspo_lightning.training.update import no_grad_micro_batch, plan_batches


def plan(micro=None, tokens=None, prompts=4, group=8, world=1):
    return plan_batches(prompts, world, group_size=group, num_mini_batches=1, mini_batch_size=None,
                        micro_batch_size=micro, ppo_epochs=1, tokens_per_response=tokens)


def test_null_micro_batch_holds_at_most_8192_tokens():
    # 32 responses of 96 + 4000 tokens: 8192 // 4096 = 2 per forward
    assert plan(tokens=96 + 4000) == (32, 2)
    # 32 of 300 tokens: 27 fit, so 2 forwards, balanced as 16 + 16
    assert plan(tokens=300) == (32, 16)
    # the quickstart: 32 responses of 8 + 6 tokens, one forward
    assert plan(tokens=8 + 6) == (32, 32)
    # a response longer than the budget still gets a forward of its own
    assert plan(tokens=20000) == (32, 1)
    # an explicit size wins, and an unknown width keeps the whole mini-batch
    assert plan(micro=5, tokens=96 + 4000) == (32, 5)
    assert plan(tokens=None) == (32, 32)


def test_passes_without_gradients_take_the_token_budget_across_mini_batches():
    # the quickstart: responses of 8 + 6 tokens, mini-batches of 32: 585 fit, so one forward of all 128
    assert no_grad_micro_batch(None, 32, 8 + 6) == 585
    # responses of 96 + 160 tokens: 32 fit in 8192, more than the planned 8
    assert no_grad_micro_batch(None, 8, 96 + 160) == 32
    # never fewer than the grad passes take, even when the budget holds fewer
    assert no_grad_micro_batch(None, 16, 96 + 4000) == 16
    # a micro_batch_size the user set is a memory bound: kept; an unknown width keeps the plan
    assert no_grad_micro_batch(4, 4, 8 + 6) == 4
    assert no_grad_micro_batch(None, 32, None) == 32


def test_the_old_policy_pass_runs_one_forward_per_budget_not_per_mini_batch(tiny_echo):
    """4 mini-batches of 8 (the paper's schedule) over 32 short responses: the old-policy pass is one forward."""
    from types import SimpleNamespace

    module = GSPOModule(model_name_or_path="builtin:tiny-echo", num_return_sequences_in_group=8, response_length=6,
                        prompt_length=8, num_mini_batches=4)
    module.configure_model()
    module._build_updater(4)
    assert module.updater.settings.micro_batch_size == 8 and module.updater.settings.no_grad_micro_batch_size == 585
    ids = torch.randint(3, module.policy.config.vocab_size, (32, 14), generator=torch.Generator().manual_seed(2))
    rollout = SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_width=8, num_responses=32,
                              images_of=lambda rows: None)
    seen = []
    hook = module.policy.get_decoder().register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[0]),
                                                                 with_kwargs=True)
    try:
        logprobs = module._logprobs_no_grad(module.policy, rollout)
    finally:
        hook.remove()
    assert logprobs.shape == (32, 6) and seen[-1] == 32  # one response pass over all rows (after the shared prompt pass)
    assert len(seen) <= 2


@pytest.mark.filterwarnings("ignore:one optimizer step per rollout")
def test_episode_runs_and_unknown_prompt_lengths_keep_the_planned_micro_batches_without_gradients():
    from gspo_lightning.training.update import update_settings

    module = GSPOModule(model_name_or_path="builtin:tiny-echo", num_return_sequences_in_group=8, response_length=6,
                        prompt_length=8, num_mini_batches=4)
    cfg = module.settings
    kw = dict(group_size=8, response_length=6, prompts_per_step=4, world=1)
    assert update_settings(cfg.update, cfg.objective, prompt_length=8, **kw).no_grad_micro_batch_size == 585
    assert update_settings(cfg.update, cfg.objective, prompt_length=8, episodes=True, **kw).no_grad_micro_batch_size == 8
    assert update_settings(cfg.update, cfg.objective, prompt_length=None, **kw).no_grad_micro_batch_size == 8


@pytest.mark.filterwarnings("ignore:one optimizer step per rollout")
def test_the_module_plans_micro_batches_from_prompt_and_response_length():
    module = GSPOModule(model_name_or_path="builtin:tiny-echo", num_return_sequences_in_group=8, response_length=4000,
                        prompt_length=96, num_mini_batches=1)
    module._build_updater(4)
    assert module.updater.settings.micro_batch_size == 2


def test_kv_cache_bytes_by_hand(tiny_echo):
    model, _ = tiny_echo
    # tiny-echo: 2 layers x (keys + values) x 2 kv heads x head_dim 64 / 4 heads = 16, float32
    assert kv_cache_bytes_per_token(model.config, torch.float32) == 2 * 2 * 2 * 16 * 4
    # Qwen3-8B's shape: 36 layers, 8 kv heads of 128, bfloat16: 144 KiB per token
    qwen = type("Config", (), dict(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                   hidden_size=4096))()
    assert kv_cache_bytes_per_token(qwen, torch.bfloat16) == 144 * 1024


def chunk_sizes(model_tok, monkeypatch, budget, n=4, max_new_tokens=6):
    model, tok = model_tok
    engine = HFEngine()
    engine.start(EngineSpec(model_name_or_path="builtin:test", dtype="float32", prompt_length=None, response_length=16,
                            seed=0, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=model))
    monkeypatch.setattr(hf, "KV_CACHE_BUDGET_BYTES", budget)
    sizes = []
    sample = engine._sample_groups

    def spy(prompts, *args, **kwargs):
        sizes.append(len(prompts) * n)
        return sample(prompts, *args, **kwargs)

    monkeypatch.setattr(engine, "_sample_groups", spy)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10], [5, 5, 5], [4, 3]]
    out = engine.generate(prompts, n, SamplingParams(max_new_tokens=max_new_tokens), seed=0)
    assert out.completion_ids.shape[0] == len(prompts) * n
    return sizes


def test_null_generation_batch_keeps_the_kv_cache_in_budget(tiny_echo, monkeypatch):
    """512 bytes per token, 3 + 6 tokens per response: 4608 bytes. A budget of 40000 bytes
    holds 8 responses, two groups of 4; the default 4 GiB holds every response here."""
    assert chunk_sizes(tiny_echo, monkeypatch, 40000) == [8, 8, 4]
    assert chunk_sizes(tiny_echo, monkeypatch, 4 * 2**30) == [20]
    # less than one group's cache: one group at a time
    assert chunk_sizes(tiny_echo, monkeypatch, 100) == [4, 4, 4, 4, 4]
