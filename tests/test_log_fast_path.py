"""training/log_fast_path.py: self.log skips Lightning's per-call walk only where it would change nothing."""

from __future__ import annotations

import csv

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.connectors.logger_connector import result as lightning_result
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric

from gspo_lightning.training import log_fast_path
from gspo_lightning.training.log_fast_path import _tensors_all_on


@pytest.fixture
def lightning_to(monkeypatch):
    """Lightning's own ``_ResultMetric.to``, restored after the test whatever it installs."""
    original = _ResultMetric.__dict__["to"]
    while getattr(original, "__closure__", None) and getattr(original, log_fast_path._MARK, False):
        original = next(c.cell_contents for c in original.__closure__ if callable(c.cell_contents))
    monkeypatch.setattr(_ResultMetric, "to", original)
    return original


def test_install_wraps_once_and_keeps_lightning_method_for_other_calls(lightning_to):
    assert log_fast_path.install()
    wrapped = _ResultMetric.__dict__["to"]
    assert wrapped is not lightning_to and getattr(wrapped, log_fast_path._MARK)
    assert log_fast_path.install() and _ResultMetric.__dict__["to"] is wrapped  # idempotent: no wrapper of a wrapper


def test_install_leaves_a_method_someone_else_replaced(monkeypatch, lightning_to):
    def theirs(self, *args, **kwargs):
        return self

    monkeypatch.setattr(_ResultMetric, "to", theirs)
    assert not log_fast_path.install()
    assert _ResultMetric.__dict__["to"] is theirs


def _count_walks(monkeypatch) -> list:
    walks = []
    real = lightning_result.apply_to_collection

    def counting(*args, **kwargs):
        walks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(lightning_result, "apply_to_collection", counting)
    return walks


def test_same_device_log_skips_the_walk_and_keeps_the_values(monkeypatch, lightning_to):
    log_fast_path.install()
    results = _ResultCollection(training=True)
    walks = _count_walks(monkeypatch)
    for step, value in enumerate([1.5, 2.5, 4.0]):
        results.log("training_step", "reward", torch.tensor(value), on_step=True, on_epoch=True, batch_size=2)
    assert walks == []  # Lightning's method walks on each of these three calls
    metric = results["training_step.reward"]
    assert metric.value.item() == pytest.approx((1.5 + 2.5 + 4.0) * 2)  # sum of value x batch size
    assert metric.cumulated_batch_size.item() == 6


def test_other_device_or_keywords_still_take_lightnings_walk(monkeypatch, lightning_to):
    log_fast_path.install()
    results = _ResultCollection(training=True)
    results.log("training_step", "loss", torch.tensor(0.25), on_step=True, on_epoch=False, batch_size=1)
    metric = results["training_step.loss"]
    walks = _count_walks(monkeypatch)
    metric.to(torch.device("meta"))  # another device: moved, by Lightning's code
    assert walks and metric.value.device.type == "meta" and metric.cumulated_batch_size.device.type == "meta"
    walks.clear()
    metric.to(device=torch.device("meta"))  # keyword arguments: never the fast path, even to the same device
    assert walks


def test_tensor_check_looks_into_containers_and_refuses_modules():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert _tensors_all_on({"a": torch.zeros(1), "b": {"c": [torch.zeros(1), (torch.zeros(1), 3)]}, "d": "x"}, cpu)
    assert not _tensors_all_on({"a": torch.zeros(1), "b": {"c": [(torch.zeros(1, device="meta"),)]}}, cpu)
    assert not _tensors_all_on({"a": torch.zeros(1, device="meta")}, cpu)
    assert _tensors_all_on({"a": torch.zeros(1, device="meta")}, meta)
    # a torchmetrics Metric logged as the value may hold tensors elsewhere: the full walk handles it
    assert not _tensors_all_on({"value": torchmetrics.MeanMetric()}, cpu)


class _Logging(L.LightningModule):
    """Five metrics a step through self.log / log_dict, one monitored by a checkpoint callback."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log_dict({"loss": loss, "a": batch[0].sum(), "b": float(batch_idx) * 0.5}, on_step=True, on_epoch=True,
                      batch_size=len(batch[0]))
        self.log("c", batch[0].max(), on_step=True, on_epoch=False, prog_bar=True, batch_size=len(batch[0]))
        self.log("d", torch.tensor(batch_idx, dtype=torch.float64), reduce_fx="max", on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(24, 3, generator=torch.Generator().manual_seed(7)))
        return torch.utils.data.DataLoader(data, batch_size=4)


def _fit(folder) -> tuple[list[dict], dict]:
    L.seed_everything(3)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=CSVLogger(folder, name="csv"), log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=folder, monitor="a_epoch", mode="max")])
    trainer.fit(_Logging())
    rows = list(csv.DictReader(open(next(folder.rglob("metrics.csv")))))
    return rows, {key: float(value) for key, value in trainer.callback_metrics.items()}


def test_a_fit_logs_and_monitors_the_same_values_either_way(tmp_path, lightning_to):
    rows_lightning, callback_lightning = _fit(tmp_path / "lightning")
    assert log_fast_path.install()
    rows_ours, callback_ours = _fit(tmp_path / "ours")
    assert rows_ours == rows_lightning and len(rows_ours) >= 12
    assert callback_ours == callback_lightning and {"loss_step", "a_epoch", "c", "d"} <= set(callback_ours)
