"""One gspo-lightning measurement in its own process: ``python _gspo_child.py CONFIG.json``.

Runs ``GSPOModule`` in a Lightning ``Trainer`` exactly as ``gspo fit`` would, minus loggers
and checkpoints, and writes ``result.json`` (per-step wall time, the module's own phase
timings, RSS) to the config's ``out_dir``.
"""

from __future__ import annotations

import sys
import time
import warnings

from _common import BenchConfig, ChildResult, StepClock, bench_reward, peak_rss_mib, reset_peak_rss, rss_mib, versions

PHASES = {"generate": "time/generate", "score": "time/score", "logprobs": "time/logprobs",
          "train": "time/train", "weight_sync": "time/weight_sync"}


def main(config_path: str) -> None:
    cfg = BenchConfig.load(config_path)
    start = time.perf_counter()
    import torch

    torch.set_num_threads(cfg.threads)
    import lightning as L

    from gspo_lightning.data import PromptDataModule
    from gspo_lightning.module import GSPOModule

    result = ChildResult("gspo", cfg.size, versions=versions())
    profiler = None

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            # Same response length as TRL's min_new_tokens: no token ends a response early.
            # (The engine has no "ignore_eos" option; -1 is never sampled.)
            pl_module.engine.eos_token_ids = [-1]
            result.setup_s = time.perf_counter() - start
            result.baseline_rss_mib = rss_mib()
            result.load_peak_rss_mib = peak_rss_mib()
            result.peak_reset = reset_peak_rss()
            rollout_hook = pl_module.on_train_batch_start

            def after_rollout(*args, **kwargs):
                # module hooks run after every callback's, so the rollout callback is done here
                result.rollout_peak_rss_mib.append(peak_rss_mib())
                reset_peak_rss()
                return rollout_hook(*args, **kwargs)

            pl_module.on_train_batch_start = after_rollout
            self.clock = StepClock()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            reset_peak_rss()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            nonlocal profiler
            result.update_peak_rss_mib.append(peak_rss_mib())
            self.clock.lap(result)
            metrics = trainer.callback_metrics
            for phase, key in PHASES.items():
                result.add_phase(phase, float(metrics.get(key, 0.0)))
            result.add_phase("step_internal", float(metrics["time/step"]))
            result.response_length_mean.append(float(metrics["response/length_mean"]))
            # sanity: the engine's sampled-token log-probs agree with the trainer's recomputation
            result.extra.setdefault("engine_logprob_abs_diff", []).append(float(metrics.get("engine/logprob_abs_diff", float("nan"))))
            if cfg.cprofile and len(result.step_wall_s) == cfg.warmup:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            self.clock.mark()

        def on_train_end(self, trainer, pl_module):
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(cfg.cprofile)
            result.finish_memory()

    if cfg.gspo_patch:
        # experiments: try a change to gspo_lightning without editing it (see README)
        exec(compile(open(cfg.gspo_patch).read(), cfg.gspo_patch, "exec"), {"__name__": "gspo_patch"})
        result.extra["patch"] = cfg.gspo_patch
    result.extra["overrides"] = cfg.gspo_overrides
    L.seed_everything(cfg.seed, verbose=False)
    module = GSPOModule(
        model_name_or_path=cfg.model_dir,
        dtype="float32",
        gradient_checkpointing=False,
        rewards=[bench_reward],
        num_return_sequences_in_group=cfg.group_size,
        response_length=cfg.response_length,
        temperature=1.0,
        adv_estimator="grpo",
        importance_sampling="seq",
        clip_low=3e-4,
        clip_high=4e-4,
        loss_agg_mode="seq-mean-token-mean",  # TRL loss_type="grpo": mean over sequences of token means
        max_grad_norm=1.0,
        rollout_seed=cfg.seed,
        optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0),
        **cfg.gspo_overrides,
    )
    data = PromptDataModule(path=cfg.prompts_file, prompt_field="prompt", rollout_batch_size=cfg.prompts_per_step,
                            prompt_length=4096, shuffle=False, val_size=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=cfg.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=cfg.out_dir, callbacks=[Probe()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    result.extra["policy_version"] = module.policy_version
    result.write(cfg.out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
