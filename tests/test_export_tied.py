"""Export from a checkpoint when the model class declares no tied weights (None)."""

import pytest

from gspo_lightning.run.export import export_checkpoint
from tests.helpers_fit import fit, make_module


def test_export_from_a_checkpoint_with_no_tied_weights_declared(tmp_path, monkeypatch):
    module = make_module(num_mini_batches=1, old_logprobs="engine")
    trainer = fit(module, tmp_path, max_steps=1)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    # transformers models without tied weights may carry _tied_weights_keys = None: `k not in None` raised
    monkeypatch.setattr(type(module.policy), "_tied_weights_keys", None, raising=False)
    exported = export_checkpoint(tmp_path / "model.ckpt", tmp_path / "export")
    assert (exported / "model.safetensors").exists()


def test_export_still_refuses_a_checkpoint_of_another_model(tmp_path):
    module = make_module(num_mini_batches=1, old_logprobs="engine")
    trainer = fit(module, tmp_path, max_steps=1)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    import torch

    state = torch.load(tmp_path / "model.ckpt", map_location="cpu", weights_only=False)
    state["state_dict"] = {k: v for k, v in state["state_dict"].items() if "layers.0." not in k}
    torch.save(state, tmp_path / "broken.ckpt")
    with pytest.raises(ValueError, match="does not match"):
        export_checkpoint(tmp_path / "broken.ckpt", tmp_path / "export")
