"""The reward model (rewards/reward_model.py) from a folder written by save_pretrained, and both
model rewards (the judge, over real HTTP) in a training run."""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from gspo_lightning.errors import ConfigError
from gspo_lightning.models.tiny import TINY_MODELS, build_tokenizer
from gspo_lightning.rewards import RewardModel, RewardSpec
from tests.helpers_fit import fit, make_module
from tests.helpers_judge import JudgeServer


def save_reward_model(folder, num_labels=1, seed=3):
    tokenizer = build_tokenizer(TINY_MODELS["tiny-echo"])
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  num_labels=num_labels, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory):
    return str(save_reward_model(tmp_path_factory.mktemp("rm")))


PROMPTS = ["repeat 1 2", [{"role": "user", "content": "repeat 3"}], "repeat 4 5 6 7 8", "repeat 9"]
COMPLETIONS = ["1 2", "3 3 3 3 3 3", [{"role": "assistant", "content": "4 5"}, {"role": "user", "content": "6"}], ""]


def by_hand(folder, prompts, completions):
    """Each sample alone, unpadded: the chat template's text, the backbone, the score head on the
    last token (the classification model's own pooling not used)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    out = []
    for prompt, completion in zip(prompts, completions):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        messages = messages + (completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}])
        ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False,
                        return_tensors="pt").input_ids
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
            out.append(float(model.score(hidden)[0]))
    return out


def test_batched_scores_equal_each_sample_scored_alone(rm_folder):
    expected = by_hand(rm_folder, PROMPTS, COMPLETIONS)
    assert len(set(expected)) == 4  # the samples differ, so the comparison means something
    for batch_size in (1, 3, 4):
        got = RewardModel(rm_folder, batch_size=batch_size)(prompts=PROMPTS, completions=COMPLETIONS, answer=[1] * 4)
        assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-5, batch_size


def test_sigmoid_normalization_frozen_eval_model_on_its_device(rm_folder):
    reward = RewardModel(rm_folder, batch_size=2, normalize="sigmoid", device="cpu")
    raw = by_hand(rm_folder, PROMPTS, COMPLETIONS)
    got = reward(prompts=PROMPTS, completions=COMPLETIONS)
    assert max(abs(g - 1 / (1 + math.exp(-r))) for g, r in zip(got, raw)) < 1e-6
    assert not reward.model.training and not any(p.requires_grad for p in reward.model.parameters())
    assert reward.device == torch.device("cpu")


def test_load_errors_name_the_problem(tmp_path, rm_folder):
    with pytest.raises(ConfigError, match="no folder './no/such/rm'"):
        RewardModel("./no/such/rm")
    with pytest.raises(ConfigError, match="has 2 outputs; a reward model has one"):
        RewardModel(str(save_reward_model(tmp_path / "two", num_labels=2)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="cannot load .*empty.* as a sequence-classification model"):
        RewardModel(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="normalize must be null or one of"):
        RewardModel(rm_folder, normalize="zscore")


def test_a_run_trains_on_a_judge_and_a_reward_model_and_logs_each(tmp_path, rm_folder, monkeypatch):
    with JudgeServer() as server:
        monkeypatch.setenv("JUDGE_KEY", server.key)
        rewards = [
            RewardSpec(function="gspo_lightning.rewards.LLMJudge", factory=True, name="judge", weight=0.1,
                       kwargs={"base_url": server.url, "model": "judge", "prompt": "DIGITS:{completion}",
                               "api_key_env": "JUDGE_KEY", "max_concurrency": 4}),
            RewardSpec(function="gspo_lightning.rewards.RewardModel", factory=True, name="rm",
                       kwargs={"model_name_or_path": rm_folder, "batch_size": 8, "normalize": "sigmoid"}),
        ]
        module = make_module(rewards=rewards)
        trainer = fit(module, tmp_path, max_steps=3)
    logged = trainer.logged_metrics
    assert len(server.requests) == 3 * 4 * 4  # every response of every step judged once
    assert float(logged["reward/judge/failed"]) == 0.0
    assert 0 < float(logged["reward/rm"]) < 1 and float(logged["reward/judge"]) >= 0
    total = 0.1 * float(logged["reward/judge"]) + float(logged["reward/rm"])
    assert abs(float(logged["reward/mean"]) - total) < 1e-5


@pytest.mark.parametrize("doc, section", [("config.md", "### Rewards from models"), ("rewards.md", "# Rewards from models")])
def test_the_worked_examples_of_the_docs_run(doc, section, tmp_path, rm_folder, monkeypatch):
    """The judge and reward model of docs/config.md and docs/rewards.md, pointed at the test's
    endpoint and folder: the template filled from the prompt, completion and answer column, the
    judge's grades scaled, the reward model's scores weighted in."""
    import re
    from pathlib import Path

    import yaml

    from gspo_lightning.rewards import RewardComposer

    text = (Path(__file__).resolve().parents[1] / "docs" / doc).read_text()
    example = re.findall(r"```yaml\n(.*?)```", text[text.index(section):], re.S)[0]
    rewards = yaml.safe_load(example)["model"]["rewards"]
    with JudgeServer() as server:
        monkeypatch.setenv("JUDGE_API_KEY", server.key)
        rewards[0]["kwargs"]["base_url"] = server.url
        rewards[1]["kwargs"]["model_name_or_path"] = rm_folder
        composer = RewardComposer(rewards)
        total, parts, scored = composer(prompts=["two and two", "three"], completions=["SCORE=10", "SCORE=4"],
                                        completion_ids=None, columns={"answer": ["4", "3"]})
    assert parts["judge"] == [1.0, 0.4]
    sent = server.requests[0]["messages"][0]["content"]
    assert "two and two" in sent and "SCORE=10" in sent and "4" in sent.replace("SCORE=10", "")
    weight = {r["name"]: r.get("weight", 1.0) for r in rewards}["rm"]
    rm = RewardModel(rm_folder, normalize="sigmoid")(prompts=["two and two", "three"], completions=["SCORE=10", "SCORE=4"])
    assert all(abs(t - (j + weight * r)) < 1e-6 for t, j, r in zip(total, parts["judge"], rm)) and all(scored)


@pytest.mark.slow
def test_the_reward_model_recipe_learns_the_task_from_the_reward_models_scores_alone(tmp_path):
    """configs/reward_model_successor.yaml as docs/rewards.md runs it (scripts/model_reward_recipes.py:
    the reward model trained from preference pairs, then `gspo fit` in another folder): the task's
    own score (weight 0, never trained on) rises from chance to >= 0.85, and the export, loaded with
    AutoModelForCausalLM, answers next 0-9 outside the trainer."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "model_reward_recipes.py"
    done = subprocess.run([sys.executable, str(script), "reward-model", "--out", str(tmp_path), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 120 and summary["rewarded_first_tenth"] < 0.2 and summary["rewarded_last_tenth"] >= 0.85
    assert summary["export_all_right"] >= 0.8
