"""The GSM8K recipe: CPU smoke run through the CLI, and the GPU config parses."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gspo_lightning.cli import main
from gspo_lightning.data.datamodule import PromptDataModule

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "gspo_lightning" / "data" / "datasets" / "gsm8k" / "train.jsonl"


@pytest.mark.slow
def test_cpu_smoke_config_runs_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: the config must not depend on where it runs
    main(["fit", "--config", str(ROOT / "configs" / "gsm8k_cpu_smoke.yaml"), "--trainer.max_steps=4",
          "--trainer.val_check_interval=1", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
          "--trainer.enable_model_summary=false"])
    run = tmp_path / "runs" / "gsm8k_smoke" / "csv" / "version_0"
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    for key in ("reward/math_accuracy", "reward/format_reward", "val/pass@1", "val/pass@4"):
        assert key in header, key
    records = [json.loads(line) for line in (run / "eval_results.jsonl").read_text().splitlines()]
    # an evaluation after every rollout step, each of 2 optimizer steps (4 prompts x 4 / mini_batch_size 8)
    assert [(r["step"], r["policy_version"]) for r in records] == [(1, 2), (2, 4), (3, 6), (4, 8)]
    for r in records:  # the tiny model, 4 steps from random weights, solves no GSM8K problem
        assert r["val/pass@4"] == r["val/pass@1"] == r["val/accuracy"] == 0.0
        assert 1 <= r["val/response_length"] <= 32  # response_length
    assert (run / "hf_model" / "model.safetensors").exists()


def test_file_without_val_path_holds_out_its_last_rows(tiny_gsm8k):
    dm = PromptDataModule(path="builtin:gsm8k", prompt_field="question", val_size=5)
    dm.tokenizer = tiny_gsm8k[1]
    dm.setup("fit")
    lines = GSM8K.read_text().splitlines()
    held_out = [json.loads(line)["question"] for line in lines[-5:]]
    assert [r["row"]["question"] for r in dm.val_rows] == held_out
    assert len(dm.train_rows) == len(lines) - 5
    assert not set(held_out) & {r["row"]["question"] for r in dm.train_rows}


def test_gpu_recipe_parses():
    result = subprocess.run([sys.executable, "-m", "gspo_lightning.cli", "fit", "--config", "configs/gsm8k_qwen3.yaml",
                             "--print_config"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert config["model"]["objective"]["importance_sampling"] == "seq" and config["model"]["engine"]["class_path"] == "gspo_lightning.rollout.VLLMEngine"
    # the comments say what the run is: max_steps counts rollout steps, each of
    # rollout_batch_size x G / mini_batch_size optimizer steps (x ppo_epochs)
    text = (ROOT / "configs" / "gsm8k_qwen3.yaml").read_text()
    steps, minis, optimizer_steps = map(int, re.search(
        r"max_steps: (\d+) +# rollout steps \(x (\d+) mini-batches = (\d+) optimizer steps\)", text).groups())
    model, data = config["model"], config["data"]
    rollout, update = model["rollout"], model["update"]
    per_rollout = data["rollout_batch_size"] * rollout["num_return_sequences_in_group"] // update["mini_batch_size"]
    assert (steps, minis, optimizer_steps) == (config["trainer"]["max_steps"], per_rollout * update["ppo_epochs"], steps * minis)
    interval, interval_optimizer_steps = map(int, re.search(
        r"every_n_train_steps: (\d+) +# rollout steps \((\d+) optimizer steps\)", text).groups())
    assert interval == config["checkpoint"]["every_n_train_steps"] and interval_optimizer_steps == interval * minis


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "configs" / "scale").glob("*.yaml")))
def test_scaling_presets_parse_on_top_of_the_recipe(preset, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "configs/gsm8k_qwen3.yaml", "--config", f"configs/scale/{preset}", "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    preset_config = yaml.safe_load((ROOT / "configs" / "scale" / preset).read_text())
    assert_contains(printed, preset_config)  # the preset's strategy, devices, ... override the recipe's
    assert printed["trainer"]["strategy"] != "auto"


def assert_contains(config, expected, where="config"):
    """Every key of ``expected`` is in ``config`` with its value (dicts: recursively)."""
    for key, value in expected.items():
        assert key in config, f"{where}.{key} missing"
        if isinstance(value, dict):
            assert_contains(config[key], value, f"{where}.{key}")
        else:
            assert config[key] == value, f"{where}.{key}: {config[key]!r} != {value!r}"
