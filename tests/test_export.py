"""Export round trip: the saved folder loads back in transformers with the same log-probs."""

import lightning as L
import torch
from transformers import AutoModelForCausalLM

from gspo_lightning.export import export_checkpoint
from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.models import load_tokenizer
from tests.test_module import fit, make_module


def test_fit_exports_and_checkpoint_export_round_trips(tmp_path):
    module = make_module()
    trainer = fit(module, tmp_path, max_steps=2)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    exported = export_checkpoint(tmp_path / "model.ckpt", tmp_path / "export")
    assert (exported / "model.safetensors").exists() and (exported / "tokenizer.json").exists()

    tokenizer = load_tokenizer(str(exported))
    text = "repeat 7 7 7"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # spaces survive
    reloaded = AutoModelForCausalLM.from_pretrained(exported)
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        original, _ = response_logprobs(module.policy.eval(), ids, mask, 2)
        again, _ = response_logprobs(reloaded.eval(), ids, mask, 2)
    torch.testing.assert_close(again, original, atol=1e-6, rtol=1e-6)
    # the trained weights, not the initial ones
    L.seed_everything(0, verbose=False)
    fresh = make_module()
    fresh.configure_model()
    with torch.no_grad():
        initial, _ = response_logprobs(fresh.policy.eval(), ids, mask, 2)
    assert not torch.allclose(initial, original)

    # export_on_fit_end wrote the same weights
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model")
    for (name, a), b in zip(reloaded.state_dict().items(), auto.state_dict().values()):
        assert torch.equal(a, b), name
