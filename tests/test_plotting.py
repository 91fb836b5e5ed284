"""Training curves: the held-out accuracy is drawn once per validation, next to the reward."""

from types import SimpleNamespace

import torch

from gspo_lightning.run.plotting import TrainingCurves, plot_history


def fake_trainer(step, metrics, sanity_checking=False):
    return SimpleNamespace(global_step=step, sanity_checking=sanity_checking,
                           callback_metrics={k: torch.tensor(v) for k, v in metrics.items()})


def test_held_out_accuracy_is_recorded_per_validation_not_per_step(tmp_path):
    curves = TrainingCurves()
    # num_sanity_val_steps=-1 validates the untrained model first: the curve's step 0
    curves.on_validation_end(fake_trainer(0, {"val/accuracy": 0.0}, sanity_checking=True), None)
    curves.on_train_batch_end(fake_trainer(1, {"reward/mean": 0.1}), None, None, None, 0)
    curves.on_validation_end(fake_trainer(1, {"reward/mean": 0.1, "val/accuracy": 0.0}), None)
    # val/accuracy stays in callback_metrics after validation: it must not repeat every step
    curves.on_train_batch_end(fake_trainer(2, {"reward/mean": 0.5, "val/accuracy": 0.0}), None, None, None, 1)
    curves.on_validation_end(fake_trainer(2, {"reward/mean": 0.5, "val/accuracy": 1.0}), None)
    assert curves.history["reward/mean"] == [(1, 0.10000000149011612), (2, 0.5)]
    assert curves.history["val/accuracy"] == [(0, 0.0), (1, 0.0), (2, 1.0)]
    path = plot_history(curves.history, tmp_path / "curves.png")
    assert path.stat().st_size > 5_000
