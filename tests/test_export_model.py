"""``gspo export-model``: any model the trainer loads (``builtin:`` ones included) written as a
folder that transformers' Auto classes and a stock ``vllm serve`` load."""

from __future__ import annotations

import pytest
import torch

from gspo_lightning.cli import main
from gspo_lightning.errors import ConfigError


@pytest.mark.parametrize("name", ["builtin:tiny-successor", "builtin:tiny-gsm8k"])
def test_a_builtin_model_exports_as_a_folder_the_auto_classes_load(tmp_path, name, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gspo_lightning.models.loading import load_policy, load_tokenizer

    out = tmp_path / "exported"
    main(["export-model", "--model", name, "--out", str(out), "--seed", "7"])
    assert "vllm.entrypoints.openai.api_server --model" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    reference_tokenizer = load_tokenizer(name)
    torch.manual_seed(7)
    reference = load_policy(name, reference_tokenizer).eval()  # builtin weights: drawn after the seed
    text = "next 3" if "successor" in name else "Tom has 3 apples."
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids.tolist() == reference_tokenizer(text, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)  # the same weights, the same model
    assert tokenizer.chat_template == reference_tokenizer.chat_template  # chat requests render as in training


def test_export_in_bfloat16_and_refuse_a_folder_that_holds_files(tmp_path):
    from transformers import AutoConfig

    main(["export-model", "--model", "builtin:tiny-successor", "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    assert AutoConfig.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not an empty folder"):
        main(["export-model", "--model", "builtin:tiny-successor", "--out", str(tmp_path / "busy")])
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"  # nothing touched
    with pytest.raises(SystemExit):  # one source: --model or --checkpoint
        main(["export-model", "--out", str(tmp_path / "x")])
