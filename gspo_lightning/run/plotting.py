"""Training curves as a PNG, written at the end of ``fit`` (and on interruption)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import lightning as L

CURVES = [
    ("reward/mean", "mean reward"),
    ("val/accuracy", "held-out accuracy"),
    ("loss/clip_frac", "clip fraction"),
    ("kl", "KL to reference"),
    ("entropy", "entropy"),
    ("response/length_mean", "response length"),
    ("grad_norm", "grad norm"),
    ("loss/ratio_mean", "importance ratio (mean)"),
    ("time/step", "seconds per step"),
]


def plot_history(history: dict[str, list[tuple[int, float]]], path: Path, title: str = "GSPO training") -> Optional[Path]:
    """Plot every known curve present in ``history`` (name -> [(step, value)])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [(key, label) for key, label in CURVES if history.get(key)]
    if not present:
        return None
    cols = 2
    rows = math.ceil(len(present) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(10, 2.8 * rows), squeeze=False)
    for ax, (key, label) in zip(axes.flat, present):
        steps, values = zip(*history[key])
        sparse = key.startswith("val/")  # a point per validation, not per step
        ax.plot(steps, values, linewidth=1.2, marker="o" if sparse else None, markersize=4)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class TrainingCurves(L.Callback):
    """Keeps the logged step metrics and draws ``training_curves.png`` (plus ``history.json``)
    in the run's log folder."""

    def __init__(self) -> None:
        self.history: dict[str, list[tuple[int, float]]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for key, value in trainer.callback_metrics.items():
            if key.startswith(("val/", "test/")):
                continue  # held-out metrics stay in callback_metrics between validations
            if "/" in key or key in ("kl", "entropy", "grad_norm", "lr"):
                self.history.setdefault(key, []).append((trainer.global_step, float(value)))

    def on_validation_end(self, trainer, pl_module) -> None:
        # a sanity check (num_sanity_val_steps) is the untrained model: step 0
        for key, value in trainer.callback_metrics.items():
            if key.startswith("val/"):
                self.history.setdefault(key, []).append((trainer.global_step, float(value)))

    # saved in checkpoints, so the curves of a resumed run cover the whole run
    def state_dict(self) -> dict:
        return {"history": {key: [list(point) for point in points] for key, points in self.history.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = {key: [tuple(point) for point in points] for key, points in state_dict.get("history", {}).items()}

    def _write(self, trainer) -> None:
        folder = Path(trainer.log_dir or trainer.default_root_dir)  # a collective call: every rank
        if not trainer.is_global_zero or not self.history:
            return
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "history.json").write_text(json.dumps(self.history))
        path = plot_history(self.history, folder / "training_curves.png")
        if path is not None:
            print(f"training curves: {path}")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._write(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._write(trainer)
