"""Export round trip: the saved folder loads back in transformers with the same log-probs."""

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gspo_lightning.run.export import check_auto_tokenizer, export_checkpoint
from gspo_lightning.training.logprobs import response_logprobs
from gspo_lightning.models.loading import load_policy, load_tokenizer
from gspo_lightning.data.tasks import save_tiny
from tests.helpers_fit import fit, make_module


def test_fit_exports_and_checkpoint_export_round_trips(tmp_path):
    module = make_module()
    trainer = fit(module, tmp_path, max_steps=2)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    exported = export_checkpoint(tmp_path / "model.ckpt", tmp_path / "export")
    assert (exported / "model.safetensors").exists() and (exported / "tokenizer.json").exists()

    tokenizer = AutoTokenizer.from_pretrained(exported)  # as users load it
    text = "repeat 7 7 7"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # spaces survive
    assert tokenizer(text)["input_ids"] == module.tokenizer(text)["input_ids"]
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


@pytest.mark.parametrize("name", ["builtin:tiny-echo", "builtin:tiny-gsm8k", "builtin:tiny-moe-echo"])
def test_every_builtin_model_exports_a_tokenizer_the_auto_classes_load(tmp_path, name):
    folder = save_tiny(name, tmp_path / "model")
    ours = load_tokenizer(name)
    auto = AutoTokenizer.from_pretrained(folder)
    text = "repeat 7 7 7" if "echo" in name else "Natalia sold 48 clips in April.\nHow many in May?"
    assert auto(text)["input_ids"] == ours(text)["input_ids"]
    assert auto.decode(auto(text)["input_ids"]) == text
    assert check_auto_tokenizer(ours, folder)
    AutoModelForCausalLM.from_pretrained(folder)


def test_missing_local_model_folder_says_so_and_shows_a_hub_id(tmp_path):
    missing = str(tmp_path / "no_such_model")
    for load in (lambda: load_tokenizer(missing), lambda: load_policy(missing, None)):
        with pytest.raises(FileNotFoundError) as err:
            load()
        message = str(err.value)
        assert "does not exist" in message and "Qwen/Qwen3-1.7B" in message and "Repo id" not in message
        assert len(message.splitlines()) == 1
    with pytest.raises(FileNotFoundError, match="model folder './runs/x' does not exist"):
        load_tokenizer("./runs/x")
