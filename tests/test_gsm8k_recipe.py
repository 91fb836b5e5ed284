"""The GSM8K recipe: CPU smoke run through the CLI, and the GPU config parses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gspo_lightning.cli import main
from gspo_lightning.data import PromptDataModule

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "gspo_lightning" / "datasets" / "gsm8k" / "train.jsonl"


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
    record = json.loads((run / "eval_results.jsonl").read_text().splitlines()[-1])
    assert 0.0 <= record["val/pass@4"] <= 1.0
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
    assert config["model"]["importance_sampling"] == "seq" and config["model"]["engine"]["class_path"] == "gspo_lightning.rollout.VLLMEngine"


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "configs" / "scale").glob("*.yaml")))
def test_scaling_presets_parse_on_top_of_the_recipe(preset, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "configs/gsm8k_qwen3.yaml", "--config", f"configs/scale/{preset}", "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "strategy" in capsys.readouterr().out
