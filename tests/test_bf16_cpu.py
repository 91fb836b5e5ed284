"""bfloat16 on CPU: Lightning's ``precision: bf16-mixed`` trains through ``gspo fit`` (an option
of issue 56; docs/benchmarks.md has the bf16 engine's measurements)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from gspo_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_bf16_mixed_trains_the_quickstart_on_cpu(tmp_path):
    main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.precision=bf16-mixed",
          "--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
          "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
          "--model.export_on_fit_end=false", "--seed_everything=4"])
    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("reward/mean")]
    assert len(rows) == 3
    assert all(math.isfinite(float(r["loss/policy"])) and math.isfinite(float(r["grad_norm"])) for r in rows)
    # the engine's log-probs and the trainer's recomputation under autocast differ by bf16's
    # rounding: more than float32's ~1e-7, far less than a broken ratio's ~1
    gap = max(float(r["engine/logprob_abs_diff"]) for r in rows)
    assert 1e-6 < gap < 0.1, gap
