"""Every code example of docs/episodes.md runs: its Python files are written and imported, its
``model.episodes`` blocks build, the Guess environment trains a step from random weights, and
TRL's documented class answers its calls and feeds ``environments=``."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path
from typing import Optional

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "episodes.md").read_text()
PYTHON = re.findall(r"```python\n(.*?)```", DOC, re.S)
YAML = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", DOC, re.S)]


@pytest.fixture
def doc_modules(tmp_path, monkeypatch):
    """Each ``# name.py`` block written as that module, importable."""
    names = []
    for block in PYTHON:
        first = block.splitlines()[0]
        match = re.match(r"# (\w+)\.py\b", first.strip())
        assert match, f"a Python example of docs/episodes.md names no file: {first!r}"
        (tmp_path / f"{match.group(1)}.py").write_text(block)
        names.append(match.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield {name: importlib.import_module(name) for name in names}
    for name in names:
        sys.modules.pop(name, None)


def test_every_episodes_block_of_the_docs_builds(doc_modules):
    from jsonargparse import ArgumentParser

    from gspo_lightning.episodes import MultiTurn

    blocks = [b["model"]["episodes"] for b in YAML if "episodes" in (b.get("model") or {})]
    assert len(blocks) == 5  # tools, TRL's environment_factory, SkyRL-gym, OpenEnv, verifiers
    parser = ArgumentParser()
    parser.add_argument("--episodes", type=Optional[MultiTurn])
    for block in blocks:
        environment = str(block.get("environment", {}).get("class_path", ""))
        if environment.endswith(("SkyRLEnvironment", "OpenEnvEnvironment")):
            package = "skyrl_gym" if "SkyRL" in environment else "openenv"
            if importlib.util.find_spec(package) is None:
                continue  # an extra this environment does not have
        episodes = parser.instantiate_classes(parser.parse_object({"episodes": block})).episodes
        if "verifiers" in block:  # verifiers' harness is the episode's agent
            assert episodes.agent == "gspo_lightning.episodes.verifiers.verifiers_agent"
            assert episodes.agent_args["verifiers"] == {"runtime": "subprocess", **block["verifiers"]}
            continue
        assert isinstance(episodes, MultiTurn) and episodes.environment is not None


def test_the_guess_environment_of_the_docs_trains_from_random_weights(doc_modules, tmp_path):
    from gspo_lightning.cli import main
    from tests.helpers_episodes import logged

    rows = [{"prompt": "Guess my number from 0 to 9.", "secret": n % 10} for n in range(40)]
    (tmp_path / "guess.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "seed_everything": 2,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "limit_val_batches": 0, "num_sanity_val_steps": 0,
                    "enable_progress_bar": False, "default_root_dir": str(tmp_path / "run")},
        "model": {"model_name_or_path": "builtin:tiny-gsm8k", "export_on_fit_end": False,
                  "episodes": {"environment": {"class_path": "guess.Guess"}, "max_turns": 3, "max_turn_tokens": 4,
                               "end_of_turn": ""},
                  "rollout": {"num_return_sequences_in_group": 4, "response_length": 32},
                  "update": {"mini_batch_size": 16}},
        "data": {"path": str(tmp_path / "guess.jsonl"), "rollout_batch_size": 4, "prompt_length": 24, "val_size": 0},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(tmp_path / "cfg.yaml")])
    rows = logged(tmp_path / "run")
    assert len(rows) == 2 and all(r["episode/ended_environment_error"] == 0 for r in rows)


def test_the_trl_class_of_the_docs_answers_its_calls_and_feeds_environments(doc_modules):
    from gspo_lightning.episodes import MultiTurn

    my_envs = doc_modules["my_envs"]
    episodes = MultiTurn(environment_factory="my_envs.IncrementEnv")
    episode = episodes.environment.fresh()
    prompt = [{"role": "user", "content": "Add 2, then 5."}]
    assert episode.reset({"prompt": prompt}, prompt) == prompt
    for step, total in ((2, "2"), (5, "7")):
        call = f'<tool_call>{{"name": "increment", "arguments": {{"step": {step}}}}}</tool_call>'
        assert episode.step({"role": "assistant", "content": call}).messages[0]["content"] == total
    assert my_envs.counter_reward(completions=[[]], environments=[episode.for_rewards()]) == [7.0]


def test_the_my_tools_example_is_a_tool():
    from gspo_lightning.episodes import Tool

    namespace: dict = {}
    exec(next(b for b in PYTHON if b.startswith("# my_tools.py")), namespace)
    assert Tool(namespace["add"])({"a": 2, "b": 3}, timeout_s=1.0) == "5"
