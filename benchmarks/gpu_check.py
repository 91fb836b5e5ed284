"""The GPU path run for real: one script for a lent GPU machine, every figure to a JSON file.

    python benchmarks/gpu_check.py --out OUT            # all stages (about 10 minutes on an H100)
    python benchmarks/gpu_check.py --out OUT --stages memory --cases 512,512-ckpt

Stages (each in its own process, with a time limit, so one failure leaves the others):

- ``pytest``: the tests marked ``gpu`` (FSDP2 on one GPU, FSDP1's refusal, DeepSpeed ZeRO-3 where installed).
- ``quickstart``: ``gspo fit --config configs/quickstart.yaml`` on the GPU in bf16 (weights and
  precision ``bf16-true``): the reward must still rise.
- ``async``, ``sapo``, ``cispo``, ``gmpo``, ``lora``, ``episodes``, ``vlm``: the same for the asynchronous run,
  the objectives beside GSPO's clip, LoRA adapters, multi-turn episodes with a tool and the vision-language
  colour recipe (``QUICKSTARTS``).
- ``memory``: a random-init model of Qwen3-0.6B's shape (28 layers, hidden 1024, 151,936-token
  vocabulary, built here: nothing is downloaded), a few GSPO steps with a KL reference per case;
  per phase (generate, no-grad log-prob passes, update, optimizer step) the peak GPU memory of a
  steady-state step (``torch.cuda.max_memory_allocated``) and its time; the HF engine's decode
  tokens/s; the update's model FLOPs utilisation against the card's dense bf16 peak; the memory
  model's prediction (``benchmarks/memory_model.py``) for the same run and its error; the bf16 gap
  between the engine's and the trainer's log-probs of the same tokens.

Results: ``OUT/gpu_check.json`` (one entry per stage and case) and a table on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

# dense bf16 peak of the cards this runs on (NVIDIA datasheets, SXM, without sparsity)
BF16_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}

# name: Run overrides on top of CASE_RUN
MEMORY_CASES = {
    "512": {},
    "512-ckpt": {"gradient_checkpointing": True},
    "512-fsdp2-ckpt": {"strategy": "fsdp2", "gradient_checkpointing": True},
    "2048-ckpt": {"response_length": 2048, "gradient_checkpointing": True},
}


# name: (config, overrides) of a `gspo fit` run on the GPU in bf16 (the reward must rise)
QUICKSTARTS = {
    "quickstart": ("configs/quickstart.yaml", []),
    # asynchronous: rollouts one step ahead from a float32 copy on a background thread
    "async": ("configs/quickstart.yaml", ["--model.max_staleness=1", "--model.engine=gspo_lightning.rollout.HFCopyEngine",
                                          "--model.engine.dtype=float32", "--model.off_policy.mode=decoupled"]),
    # adapters on the frozen tiny model (a higher rate: the adapters start at zero)
    "lora": ("configs/quickstart.yaml", ["--model.lora.rank=16", "--model.lora.alpha=32",
                                         "--model.lora.target_modules=all-linear", "--model.optimizer.init_args.lr=0.005"]),
    # multi-turn episodes with a tool
    "episodes": ("configs/episodes_lookup.yaml", []),
    # the objectives beside GSPO's clip, at their documented defaults
    "sapo": ("configs/quickstart.yaml", ["--model.policy_loss_type=sapo"]),
    "cispo": ("configs/quickstart.yaml", ["--model.policy_loss_type=cispo"]),
    "gmpo": ("configs/quickstart.yaml", ["--model.policy_loss_type=gmpo"]),
    # vision-language: the tiny Qwen2.5-VL-architecture model names colours in generated images
    "vlm": ("configs/quickstart_vlm.yaml", []),
}


def case_run():
    from memory_model import Run

    # 8 prompts x 4 responses a step, 2 optimizer steps of 16, micro-batches of 4
    return Run(ranks=1, strategy="ddp", precision="bf16", prompt_length=128, response_length=512, group_size=4,
               rollout_batch_size=8, mini_batch_size=16, micro_batch_size=4, generation_batch_size=32,
               logprob_chunk_size=512, reference=True, old_pass=True, foreach_optimizer=True)


def check_reward(prompts, completions, **columns) -> list[float]:
    """Varies inside a group, so advantages are non-zero: the share of digit characters."""
    return [sum(ch.isdigit() for ch in text) / (1 + len(text)) for text in completions]


def model_shape(dry: bool):
    from memory_model import CHECK_SHAPE, QWEN3

    return CHECK_SHAPE if dry else QWEN3["qwen3-0.6b"]


def build_model(folder: Path, dry: bool) -> Path:
    from memory_model import build_check_model

    return build_check_model(folder, model_shape(dry), max_position_embeddings=4096)


def card_peak() -> tuple[str, float]:
    import torch

    name = torch.cuda.get_device_name(0)
    for key, flops in BF16_PEAK_FLOPS.items():
        if key in name:
            return name, flops
    return name, float("nan")


def measure_case(name: str, model_dir: Path, out: Path, steps: int, dry: bool) -> None:
    """One memory case in this process (the child): phases timed and their peak GPU memory taken."""
    import warnings

    import lightning as L
    import torch

    from gspo_lightning.data.datamodule import PromptDataModule
    from gspo_lightning.rewards import RewardSpec
    from gspo_lightning.rollout import HFEngine
    from gspo_lightning.rollout.worker import RolloutWorker
    from gspo_lightning.training.module import GSPOModule
    from gspo_lightning.training.update import PolicyUpdater
    from memory_model import meta_param_shapes, param_counts, predict

    warnings.filterwarnings("ignore")
    run = replace(case_run(), **MEMORY_CASES[name])
    if dry:  # the script's own check on a CPU: a small model, short responses, no CUDA statistics
        run = replace(run, response_length=16, prompt_length=32, precision="fp32")
        for fn in ("synchronize", "reset_peak_memory_stats"):
            setattr(torch.cuda, fn, lambda: None)
        torch.cuda.max_memory_allocated = torch.cuda.max_memory_reserved = lambda: 1
        torch.cuda.get_device_name = lambda index=0: "cpu"
    step = [0]
    phases: dict[tuple[int, str], dict] = {}
    captured: dict[str, torch.Tensor] = {}

    open_phases: list[str] = []  # phases nest (the optimizer step runs inside the update)

    def fold_peak() -> None:
        """Credit the peak since the last reset to every open phase, then reset."""
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        for phase in open_phases:
            entry = phases.setdefault((step[0], phase), {"peak": 0, "seconds": 0.0})
            entry["peak"] = max(entry["peak"], peak)
        torch.cuda.reset_peak_memory_stats()

    def phased(phase, fn):
        def wrapper(*args, **kwargs):
            fold_peak()
            open_phases.append(phase)
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
                fold_peak()
            finally:
                open_phases.remove(phase)
            entry = phases.setdefault((step[0], phase), {"peak": 0, "seconds": 0.0})
            entry["seconds"] += time.perf_counter() - start
            if phase == "generate":
                captured["rollout"] = result
            elif phase == "logprobs" and "old" not in captured:
                captured["old"] = result  # the step's first pass: the old policy on the rollout's tokens
            return result
        return wrapper

    RolloutWorker.rollout = phased("generate", RolloutWorker.rollout)
    GSPOModule._logprobs_no_grad = phased("logprobs", GSPOModule._logprobs_no_grad)
    PolicyUpdater.run = phased("update", PolicyUpdater.run)
    torch.optim.AdamW.step = phased("optimizer step", torch.optim.AdamW.step)
    gaps, generated = [], []

    class StepCounter(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            step[0] = batch_idx + 1
            captured.clear()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            rollout, old = captured.get("rollout"), captured.get("old")
            if rollout is not None:
                generated.append(int(rollout.response_mask.sum()))
            if rollout is not None and old is not None:
                mask = rollout.response_mask
                diff = (old.float() - rollout.engine_logprobs.float()).abs()[mask]
                gaps.append({"mean_abs": diff.mean().item(), "max_abs": diff.max().item()})

    L.seed_everything(1234, verbose=False)
    module = GSPOModule(
        model_name_or_path=str(model_dir), dtype="float32" if dry else "bfloat16", gradient_checkpointing=run.gradient_checkpointing,
        rewards=[RewardSpec(function="gpu_check.check_reward")],
        engine=HFEngine(generation_batch_size=run.generation_batch_size),
        num_return_sequences_in_group=run.group_size, response_length=run.response_length, use_kl_loss=True,
        mini_batch_size=run.mini_batch_size, micro_batch_size=run.micro_batch_size,
        logprob_chunk_size=run.logprob_chunk_size, export_on_fit_end=False, prompt_length=run.prompt_length,
    )
    data = PromptDataModule(path="builtin:gsm8k", prompt_field="question", tokenizer=str(model_dir),
                            rollout_batch_size=run.rollout_batch_size, prompt_length=run.prompt_length,
                            overlong_prompts="truncate_left", val_size=0, shuffle=False)
    strategy = "auto"
    if run.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu" if dry else "gpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[StepCounter()], use_distributed_sampler=False,
                        precision="32-true" if dry else "bf16-true", default_root_dir=str(out.parent / "lightning"))
    start = time.perf_counter()
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
    trainer.fit(module, datamodule=data)
    fit_seconds = time.perf_counter() - start

    shape = model_shape(dry)
    last = max(s for s, _ in phases)
    steady = {phase: phases[(last, phase)] for s, phase in phases if s == last}
    pred = predict(shape, run, meta_param_shapes(shape))
    params = param_counts(shape)["total"]
    card, peak_flops = card_peak()
    tokens = generated[-1] if generated else 0
    # tokens the update trains on: prompt + response of every row (the forward covers both), 6 N T per pass
    rows = run.rollout_batch_size * run.group_size
    update_tokens = rows * run.prompt_length + tokens
    update_flops = (8 if run.gradient_checkpointing else 6) * params * update_tokens
    measured_peak = max(v["peak"] for v in steady.values())
    result = {
        "case": name, "card": card, "run": asdict(run), "steps": steps, "fit_seconds": fit_seconds,
        "phases": {p: {"peak_gib": v["peak"] / 2**30, "seconds": v["seconds"]} for p, v in steady.items()},
        "peak_gib": measured_peak / 2**30,
        "peak_phase": max(steady, key=lambda p: steady[p]["peak"]),
        "predicted": {p: pred.phase_total(p) / 2**30 for p in pred.phases},
        "predicted_peak_gib": pred.peak / 2**30, "predicted_phase": pred.peak_phase,
        "prediction_error": pred.peak / measured_peak - 1,
        "decode_tokens_per_s": tokens / steady["generate"]["seconds"] if "generate" in steady else None,
        "response_tokens": tokens,
        "update_mfu": update_flops / steady["update"]["seconds"] / peak_flops if "update" in steady else None,
        "logprob_gap_bf16": gaps,
        "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }
    out.write_text(json.dumps(result, indent=1))


def run_stage(cmd: list[str], timeout: int, log: Path, env=None) -> dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **(env or {})})
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = "timeout", exc.stdout or "", exc.stderr or ""
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    return {"rc": rc, "seconds": round(time.perf_counter() - start, 1), "tail": (stdout + stderr)[-1500:]}


def quickstart_summary(folder: Path) -> dict:
    import csv

    files = sorted(folder.rglob("metrics.csv"))
    if not files:
        return {}
    rows = list(csv.DictReader(files[-1].open()))
    rewards = [float(r["reward/mean"]) for r in rows if r.get("reward/mean")]
    accuracy = [(r.get("step"), float(r["val/accuracy"])) for r in rows if r.get("val/accuracy")]
    gaps = [float(r["engine/logprob_abs_diff"]) for r in rows if r.get("engine/logprob_abs_diff")]
    step_times = sorted(float(r["time/step"]) for r in rows if r.get("time/step"))
    return {"reward_first": rewards[0] if rewards else None, "reward_last5": sum(rewards[-5:]) / max(1, len(rewards[-5:])),
            "held_out": accuracy, "steps": len(rewards), "engine_logprob_abs_diff_mean": sum(gaps) / len(gaps) if gaps else None,
            "median_step_seconds": step_times[len(step_times) // 2] if step_times else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--stages", default="pytest,quickstart,async,lora,episodes,sapo,cispo,gmpo,vlm,memory")
    parser.add_argument("--stage_timeout", type=int, default=240, help="seconds each gspo fit may run")
    parser.add_argument("--quickstart_steps", type=int, default=100)
    parser.add_argument("--cases", default=",".join(MEMORY_CASES))
    parser.add_argument("--steps", type=int, default=2, help="steps per memory case (the last one is measured)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", type=Path, default=Path("/tmp/gpu_check_model"))
    parser.add_argument("--dry", action="store_true", help="check this script on a CPU (small model, no CUDA)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        measure_case(args.child, args.model_dir, args.out / f"memory_{args.child}.json", args.steps, args.dry)
        return 0

    import torch

    results = {"card": "cpu (dry run)" if args.dry else torch.cuda.get_device_name(0), "torch": torch.__version__, "git": os.environ.get("GIT_COMMIT")}
    try:
        import lightning
        import transformers

        results.update(lightning=lightning.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    stages = args.stages.split(",")
    report = args.out / "gpu_check.json"

    def save():
        report.write_text(json.dumps(results, indent=1))

    if "pytest" in stages:
        results["pytest"] = run_stage([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                       "--continue-on-collection-errors"], 2 * args.stage_timeout,
                                      args.out / "pytest.log")
        print("pytest -m gpu:", results["pytest"]["rc"], results["pytest"]["tail"][-300:], flush=True)
        save()
    for name, (config, extra) in QUICKSTARTS.items():
        if name not in stages:
            continue
        folder = args.out / f"{name}_bf16"
        loggers = [] if importlib.util.find_spec("tensorboard") else ["--trainer.logger=gspo_lightning.run.loggers.CSVLogger"]
        results[name] = run_stage(
            [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", config,
             "--trainer.accelerator=gpu", "--trainer.precision=bf16-true", "--model.dtype=bfloat16",
             f"--trainer.max_steps={args.quickstart_steps}", f"--trainer.default_root_dir={folder}",
             "--trainer.enable_progress_bar=false", *loggers, *extra], args.stage_timeout, args.out / f"{name}.log")
        results[name].update(quickstart_summary(folder))
        for path in folder.rglob("*"):  # keep the logs, not the weights
            if path.suffix in (".ckpt", ".safetensors", ".bin"):
                path.unlink()
        print(f"{name} bf16:", {k: v for k, v in results[name].items() if k != "tail"}, flush=True)
        if results[name]["rc"] != 0:
            print(results[name]["tail"], flush=True)
        save()
    if "memory" in stages:
        start = time.perf_counter()
        build_model(args.model_dir, args.dry)
        results["model_build_seconds"] = time.perf_counter() - start
        for name in args.cases.split(","):
            outcome = run_stage([sys.executable, str(Path(__file__)), "--out", str(args.out), "--child", name,
                                 "--model_dir", str(args.model_dir), "--steps", str(args.steps), *(["--dry"] if args.dry else [])], 300,
                                args.out / f"memory_{name}.log", env={"PYTHONPATH": f"{ROOT}:{HERE}"})
            measured = args.out / f"memory_{name}.json"
            if measured.is_file():
                outcome.update(json.loads(measured.read_text()))
            results.setdefault("memory", {})[name] = outcome
            print(f"memory {name}: rc {outcome['rc']} peak {outcome.get('peak_gib', float('nan')):.2f} GiB "
                  f"({outcome.get('peak_phase')}), predicted {outcome.get('predicted_peak_gib', float('nan')):.2f} "
                  f"({outcome.get('predicted_phase')}), decode {outcome.get('decode_tokens_per_s')} tok/s, "
                  f"MFU {outcome.get('update_mfu')}, gap {outcome.get('logprob_gap_bf16')}", flush=True)
            if outcome["rc"] != 0:
                print(outcome["tail"], flush=True)
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
