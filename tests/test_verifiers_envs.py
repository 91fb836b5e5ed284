"""verifiers environments, unchanged (model.episodes.verifiers): rows from its taskset, episodes
run by its own harness against the run's endpoint, its rewards by name, equal to the same rewards
worked out by hand from each recorded reply; and the errors that name the key to fix.

The package (and uv, which runs its harness programs) lives in an environment of its own
(verifiers pins openai<3): those tests skip without it; CI runs them in the vLLM environment.
"""

from __future__ import annotations

import math
import random
import shutil
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from gspo_lightning.data.datamodule import DataError, PromptDataModule
from gspo_lightning.data.verifiers import VerifiersTasks
from gspo_lightning.episodes.multi_turn import MultiTurn
from gspo_lightning.episodes.verifiers import VerifiersSettings
from gspo_lightning.errors import AgentError, ConfigError
from gspo_lightning.models.tiny import build_tokenizer, get_spec
from gspo_lightning.rollout.agent.processes import check_result
from gspo_lightning.rollout.engine import Generation, RolloutEngine, SamplingParams
from gspo_lightning.rollout.worker import RolloutWorker

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "verifiers"
HERE_ENVS = Path(__file__).resolve().parent / "verifiers_envs"


def has_verifiers() -> bool:
    try:
        import verifiers.v1  # noqa: F401
    except ImportError:
        return False
    return shutil.which("uv") is not None or (Path(sys.executable).parent / "uv").exists()


needs_verifiers = pytest.mark.skipif(not has_verifiers(), reason="verifiers (v1) and uv are not installed here "
                                     "(pip install 'gspo-lightning[verifiers]'; CI: the vLLM environment)")


@pytest.fixture
def environments(monkeypatch):
    """The example environment and the tests' own importable, as an installed one would be; uv
    (beside this Python) on PATH for the harness programs."""
    for folder in (EXAMPLES, HERE_ENVS):
        monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{__import__('os').environ.get('PATH', '')}")


# -- what needs no verifiers -------------------------------------------------------------------
def test_named_agent_rewards_are_summed_and_logged_by_name():
    assert check_result({"correct": 1, "format": 0.25}) == {"correct": 1.0, "format": 0.25}
    assert check_result(0.5) == 0.5 and check_result(None) is None
    for bad in ({}, {"a": "1"}, {"a": True}, {1: 0.5}, "0.5"):
        with pytest.raises(TypeError, match="the agent returned"):
            check_result(bad)
    episodes = SimpleNamespace(agent_rewards=[{"a": 1.0, "b": 0.25}, {"a": 0.0}, None, {"b": 0.5}],
                               failed=[False, False, True, False])
    total, components, scored, errors = RolloutWorker._score_agent_episodes(
        SimpleNamespace(rewards=None), episodes, [[1], [1], [1], [1]], {"columns": {}}, 2)
    assert total == [1.25, 0.0, 0.0, 0.5]
    assert scored == [True, True, False, True] and errors == 0
    assert components["a"][:2] == [1.0, 0.0] and components["a"][3] == 0.0 and math.isnan(components["a"][2])
    assert components["b"][:2] == [0.25, 0.0] and components["b"][3] == 0.5
    assert "agent" not in components  # no plain-number rewards this step


def test_settings_errors_name_the_key():
    settings = VerifiersSettings(id="successor_v1")
    with pytest.raises(ConfigError, match="exactly one of environment.*verifiers.*got agent and verifiers"):
        MultiTurn(agent="tests.helpers_agents.no_such", verifiers=settings)
    with pytest.raises(ConfigError, match="agent_args.*model.episodes.agent, which is not set"):
        MultiTurn(verifiers=settings, agent_args={"x": 1})
    with pytest.raises(ConfigError, match=r"agent_args cannot set \['api_key', 'row'\]"):
        MultiTurn(agent="gspo_lightning.data.tasks.lookup_agent.lookup_agent", agent_args={"row": 1, "api_key": "k"})
    with pytest.raises(ConfigError, match="verifiers.id is empty"):
        VerifiersSettings(id="")
    multi_turn = MultiTurn(verifiers={"id": "successor_v1", "args": {"digits": [2]}})
    assert multi_turn.agent == "gspo_lightning.episodes.verifiers.verifiers_agent"
    assert multi_turn.agent_args == {"verifiers": {"id": "successor_v1", "args": {"digits": [2]}, "eval_args": None,
                                                   "harness": "null", "runtime": "subprocess"}}


def test_data_path_errors_name_the_key():
    tokenizer = "builtin:tiny-successor-judge"
    with pytest.raises(DataError, match="model.episodes.verifiers, which is not set"):
        PromptDataModule(path="verifiers", tokenizer=tokenizer, episodes=True).setup("fit")
    with pytest.raises(DataError, match="data.path is 'builtin:successor': set data.path: verifiers"):
        PromptDataModule(path="builtin:successor", tokenizer=tokenizer, episodes=True,
                         verifiers=VerifiersTasks(id="successor_v1")).setup("fit")
    with pytest.raises(DataError, match="eval_args, which is not set"):
        PromptDataModule(path="verifiers", val_path="verifiers", tokenizer=tokenizer, episodes=True,
                         verifiers=VerifiersTasks(id="successor_v1"))._read("verifiers", "eval", seed=0)


@pytest.mark.skipif(has_verifiers(), reason="checks the error without verifiers installed")
def test_missing_package_says_how_to_install():
    with pytest.raises(ConfigError, match=r"needs the verifiers package.*pip install 'gspo-lightning\[verifiers\]'"):
        PromptDataModule(path="verifiers", tokenizer="builtin:tiny-successor-judge", episodes=True,
                         verifiers=VerifiersTasks(id="successor_v1")).setup("fit")


# -- with verifiers ------------------------------------------------------------------------------
@needs_verifiers
def test_rows_are_the_tasksets_tasks(environments):
    import verifiers.v1 as vf

    settings = VerifiersTasks(id="successor_v1", args={"digits": [2, 9], "copies": 2}, eval_args={"digits": [5]})
    data = PromptDataModule(path="verifiers", val_path="verifiers", tokenizer="builtin:tiny-successor-judge",
                            episodes=True, verifiers=settings, shuffle=False)
    data.setup("fit")
    rows = [item["row"] for item in data.train_rows]
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": f"next {d}"}] for d in (2, 2, 9, 9)]
    assert [r["target"] for r in rows] == ["3", "3", "0", "0"]
    assert [(r["verifiers_split"], r["verifiers_index"]) for r in rows] == [("train", i) for i in range(4)]
    assert [(item["row"]["target"], item["row"]["verifiers_split"]) for item in data.val_rows] == [("6", "eval")]
    # in verifiers' own order: the taskset as verifiers loads it
    config = vf.resolve_env_config({"taskset": {"id": "successor_v1", "digits": [2, 9], "copies": 2}})
    assert [t.data.target for t in vf.load_taskset(config.taskset)] == [r["target"] for r in rows]


# tiny-successor-judge's ids: <pad> 0, <eos> 1, <unk> 2, next 3, digits 4..13, answer 14, user: 15, assistant: 16
PAD, EOS, DIGIT0 = 0, 1, 4


class RandomDigitsEngine(RolloutEngine):
    """Replies of 1..6 random digits, sometimes ended by <eos>: what each episode scores varies."""

    shares_policy_weights = True

    def __init__(self, seed: int = 11):
        super().__init__()
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def start(self, spec) -> None:
        pass

    def generate(self, prompt_ids, n, params, seed):
        with self.lock:
            replies = []
            for _ in prompt_ids:
                ids = [DIGIT0 + self.rng.choice([3, 3, 3, 6, 0, 7]) for _ in range(self.rng.randint(1, 6))]
                if self.rng.random() < 0.5:
                    ids.append(EOS)
                replies.append(ids[:params.max_new_tokens])
        return Generation.from_lists(replies, [[-0.5] * len(ids) for ids in replies],
                                     [EOS not in ids for ids in replies], PAD)


def verifiers_runner(env_id: str, args: dict, **episodes):
    from gspo_lightning.rollout.agent.runner import AgentRunner

    tokenizer = build_tokenizer(get_spec("tiny-successor-judge"))
    multi_turn = MultiTurn(verifiers=VerifiersSettings(id=env_id, args=args), system_prompt_for_tools=None,
                           max_turns=1, max_turn_tokens=7, end_of_turn="", **episodes)
    multi_turn.start(tokenizer, prompt_length=8)
    return AgentRunner(multi_turn, model_name="tiny-successor-judge"), tokenizer


@needs_verifiers
def test_episodes_are_verifiers_own_and_scored_by_its_rewards(environments):
    """Each episode: verifiers' null harness sends the task's prompt to the endpoint, the endpoint
    samples and records the reply, verifiers scores it: the rewards returned equal the same two
    rewards worked out here from the recorded reply, and the recorded tokens are that reply."""
    settings = VerifiersTasks(id="successor_v1", args={"digits": [2, 6]})
    rows, _ = PromptDataModule(path="verifiers", tokenizer="builtin:tiny-successor-judge", episodes=True,
                               verifiers=settings)._read("verifiers", "train", seed=0)
    runner, tokenizer = verifiers_runner("successor_v1", {"digits": [2, 6]})
    try:
        batch = runner.run(RandomDigitsEngine(), [r["prompt"] for r in rows], rows, group_size=4,
                           params=SamplingParams(max_new_tokens=7, temperature=1.0), seed=5)
    finally:
        runner.close()
    assert batch.stats["agent/errors"] == 0 and batch.stats["agent/calls"] == 8
    assert not any(batch.failed)
    for index, reward in enumerate(batch.agent_rewards):
        row = rows[index // 4]
        assert batch.prompts[index] == [{"role": "user", "content": row["prompt"][0]["content"]}]
        reply = batch.completions[index][-1]["content"]
        words = reply.split()
        n = int(batch.generation.lengths[index])
        recorded = batch.generation.completion_ids[index, :n].tolist()
        assert tokenizer.decode([t for t in recorded if t != EOS]).split() == words  # the tokens are the reply
        assert reward == pytest.approx({"successor": sum(w == row["target"] for w in words[:4]) / 4,
                                        "short": 0.1 * (0 < len(words) <= 4)}, abs=1e-12)
    assert len({tuple(sorted(r.items())) for r in batch.agent_rewards}) > 1  # the replies scored differently


@needs_verifiers
def test_a_failing_verifiers_reward_is_an_unscored_episode_with_its_reason(environments):
    """A task whose reward raises: verifiers marks the trace failed, the episode is unscored, and
    with every episode failed the step stops with verifiers' message."""
    rows = [{"prompt": [{"role": "user", "content": "next 2"}], "verifiers_split": "train", "verifiers_index": 0}]
    runner, _ = verifiers_runner("broken_reward_v1", {})
    try:
        with pytest.raises(AgentError, match=r"2 of 2 agent episodes failed.*VerifiersEpisodeError.*broken on purpose"):
            runner.run(RandomDigitsEngine(), [r["prompt"] for r in rows], rows, group_size=2,
                       params=SamplingParams(max_new_tokens=7, temperature=1.0), seed=5)
    finally:
        runner.close()


def test_the_gspo_command_hands_the_environments_tasks_to_the_data_module():
    from tests.test_run_folder import parsed

    cfg = parsed("--config", str(ROOT / "configs" / "verifiers_successor.yaml"))
    assert dict(cfg.data.verifiers) == {"id": "successor_v1", "args": {"digits": [2]}, "eval_args": {"digits": [2, 5]}}
    assert cfg.data.path == cfg.data.val_path == "verifiers" and cfg.data.episodes is True
