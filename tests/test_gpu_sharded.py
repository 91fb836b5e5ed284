"""FSDP (FSDPStrategy, FSDP1) and DeepSpeed ZeRO-3 refuse CPU: these run where CUDA is,
and skip cleanly elsewhere. On CPU, ``tests/test_sharded_head.py`` simulates a partitioned
head and ``tests/test_sharding.py`` runs FSDP2 on 2 gloo ranks."""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu


def fit_chunked(tmp_path, strategy, max_grad_norm):
    """Two rollout steps of the echo task on one GPU, log-probs through the chunked head path
    (chunk 2, budget 0); returns the logged metrics and how far the weights moved."""
    import warnings

    import lightning as L

    from gspo_lightning.training import logprobs
    from gspo_lightning.data.datamodule import PromptDataModule
    from gspo_lightning.training.module import GSPOModule
    from gspo_lightning.rewards import RewardSpec

    budget = logprobs.response_logprobs.__kwdefaults__["max_unchunked_bytes"]
    logprobs.response_logprobs.__kwdefaults__["max_unchunked_bytes"] = 0
    try:
        L.seed_everything(3, verbose=False)
        module = GSPOModule(model_name_or_path="builtin:tiny-echo", num_return_sequences_in_group=4, response_length=5,
                            rewards=[RewardSpec(function="gspo_lightning.data.tasks.echo.echo_reward")], logprob_chunk_size=2,
                            num_mini_batches=2, max_grad_norm=max_grad_norm, export_on_fit_end=False,
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
        data = PromptDataModule(path="builtin:echo", tokenizer="builtin:tiny-echo", rollout_batch_size=4, prompt_length=8,
                                val_size=0)
        trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False,  # as the gspo command sets it (the sampler shards prompts itself)
                            num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path)
        from gspo_lightning.run import attach_run_callbacks

        attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, datamodule=data)
    finally:
        logprobs.response_logprobs.__kwdefaults__["max_unchunked_bytes"] = budget
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_fsdp1_is_refused_before_it_fails_in_backward(tmp_path):
    """On an H100 (2026-11-26) FSDP1 failed at the first backward, which runs inside its root
    forward (Lightning issue #19685): the fit now stops at setup and names FSDP2."""
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(ValueError, match="ModelParallelStrategy"):
        fit_chunked(tmp_path, FSDPStrategy(use_orig_params=True), max_grad_norm=1.0)


def test_fsdp2_on_one_gpu_syncs_its_metrics_over_nccl(tmp_path):
    """Found on the first GPU run: step metrics logged from floats were CPU aggregates, and
    NCCL (every multi-process GPU run, FSDP2 on one GPU too) has no CPU backend to sync them."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    metrics = fit_chunked(tmp_path, ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), max_grad_norm=1.0)
    assert metrics["grad_norm"] > 0 and metrics["policy_version"] == 4


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")
def test_deepspeed_zero3_logs_the_engines_grad_norm(tmp_path):
    """The head weight is a ZeRO-3 partition, gathered by its module's hooks; grad_norm is
    the engine's measurement (it was always 0)."""
    metrics = fit_chunked(tmp_path, "deepspeed_stage_3", max_grad_norm=None)
    assert metrics["grad_norm"] > 0 and metrics["policy_version"] == 4
