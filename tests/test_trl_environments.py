"""Environment classes written for TRL's ``GRPOTrainer(environment_factory=...)``, run unchanged
(``model.episodes.environment_factory``, episodes/factory.py)."""

from __future__ import annotations

import json

import pytest
import yaml
from transformers.utils import get_json_schema

from gspo_lightning.episodes import FactoryEnvironment, HermesToolCallParser, MultiTurn
from gspo_lightning.errors import ConfigError
from tests.helpers_episodes import logged, lookup_config


class IncrementEnv:
    """The example environment of TRL's environment_factory documentation, as written there."""

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        return None

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class GreetingCounter(IncrementEnv):
    """A reset that returns an observation, a private helper, a property, an async tool and
    ``get_reward``: everything of TRL's contract at once."""

    built = 0

    def __init__(self):
        GreetingCounter.built += 1

    def reset(self, prompt, start: int = 0, **row) -> str:
        self.counter = int(start)
        self.rows_seen = dict(row, prompt=prompt)
        return f" The counter starts at {self.counter}."

    @property
    def doubled(self) -> int:  # a property is not a tool (TRL lists functions on the class)
        raise AssertionError("listing tools must not evaluate properties")

    def _helper(self) -> None:
        """Private: not a tool."""

    async def double(self) -> dict:
        """Double the counter."""
        self.counter *= 2
        return {"counter": self.counter}

    def get_reward(self) -> float:
        return float(self.counter == 6)


def call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'}


def test_the_trl_docs_class_runs_as_trl_runs_it():
    template = FactoryEnvironment(IncrementEnv, parser=HermesToolCallParser())
    # the schema TRL shows the model: transformers' get_json_schema of the bound method
    assert template.tools_schema == [get_json_schema(IncrementEnv().increment)]
    assert template.scores_episodes is False
    episode = template.fresh()
    prompt = [{"role": "user", "content": "Increment by two, then by three."}]
    assert episode.reset({"prompt": prompt}, prompt) == prompt  # reset returned None: the prompt as it is
    first = episode.step(call("increment", step=2))
    assert first.messages == [{"role": "tool", "name": "increment", "content": "2"}] and not first.done
    assert episode.step(call("increment", step=3)).messages[0]["content"] == "5"
    assert episode.step({"role": "assistant", "content": "Done: 5."}).done  # no call ends it, as in TRL
    assert episode.for_rewards().counter == 5  # what reward functions get in environments=
    other = template.fresh()  # a new instance per episode: nothing carried over
    other.reset({"prompt": prompt}, prompt)
    assert other.for_rewards() is not episode.for_rewards()
    assert other.step(call("increment", step=1)).messages[0]["content"] == "1"


def test_reset_gets_the_row_and_its_string_joins_the_last_message_and_get_reward_scores():
    GreetingCounter.built = 0
    template = FactoryEnvironment("tests.test_trl_environments.GreetingCounter", parser=HermesToolCallParser())
    assert sorted(t["function"]["name"] for t in template.tools_schema) == ["double", "increment"]
    assert template.scores_episodes and template.name == "GreetingCounter"
    episode = template.fresh()
    assert GreetingCounter.built == 2  # the probe that gave the schemas, then one per episode
    prompt = [{"role": "system", "content": "Count."}, {"role": "user", "content": "Reach six."}]
    messages = episode.reset({"prompt": "Reach six.", "start": "3", "answer": "6"}, prompt)
    assert messages[-1] == {"role": "user", "content": "Reach six. The counter starts at 3."}
    assert prompt[-1]["content"] == "Reach six."  # the row's own messages are not changed
    assert episode.for_rewards().rows_seen == {"prompt": "Reach six.", "answer": "6"}
    reply = episode.step(call("double"))  # async def: awaited; a dict result becomes str(), as TRL does
    assert reply.messages[0]["content"] == str({"counter": 6})
    assert episode.rewards() == {"GreetingCounter": 1.0}


def test_a_class_without_reset_or_that_cannot_be_built_is_refused_with_the_key_name():
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: A number.
            """
            return x

    class NeedsArguments:
        def __init__(self, url):
            self.url = url

        def reset(self, **row):
            return None

    with pytest.raises(ConfigError, match="environment_factory: NoReset has no reset method"):
        FactoryEnvironment(NoReset)
    with pytest.raises(ConfigError, match=r"environment_factory: NeedsArguments\(\) raised TypeError.*no arguments"):
        FactoryEnvironment(NeedsArguments)


def test_episodes_take_exactly_one_of_environment_factory_environment_and_agent():
    with pytest.raises(ConfigError, match="exactly one of environment .*got environment and environment_factory"):
        MultiTurn(environment=FactoryEnvironment(IncrementEnv), environment_factory="x.Y")
    with pytest.raises(ConfigError, match="got none"):
        MultiTurn()
    episodes = MultiTurn(environment_factory="tests.test_trl_environments.IncrementEnv")
    assert isinstance(episodes.environment, FactoryEnvironment)
    assert isinstance(episodes.environment.parser, HermesToolCallParser)  # model.episodes.tool_call_parser's default


class CountingTable:
    """A TRL class on the lookup task that owns a reward (get_reward: it read the table once)."""

    def reset(self, table: str, **row) -> None:
        self._table = dict(zip("abcdef", table.split()))
        self.reads = 0

    def get(self, key: str) -> str:
        """Read the digit stored under a key.

        Args:
            key: A letter a to f.
        """
        self.reads += 1
        return self._table.get(key, "error")

    def get_reward(self) -> float:
        return float(self.reads == 1)


def reads_reward(completions, environments, **columns):
    """A reward function that reads the episodes' instances, as TRL's reward functions may."""
    assert all(isinstance(e, CountingTable) for e in environments) and len(environments) == len(completions)
    return [float(e.reads) for e in environments]


def counting_table_config(folder, **edit) -> str:
    """The lookup recipe's test config with CountingTable as its environment (``edit``: what to change)."""
    path = lookup_config(folder)
    config = yaml.safe_load(path.read_text())
    config["model"]["episodes"] = {
        "environment": {"class_path": "gspo_lightning.episodes.FactoryEnvironment",
                        "init_args": {"factory": "tests.test_trl_environments.CountingTable",
                                      "parser": {"class_path": "gspo_lightning.data.tasks.lookup.WordCallParser"},
                                      "error_reply": "error"}},
        "max_turns": 3, "max_turn_tokens": 3, "end_of_turn": "", "system_prompt_for_tools": None}
    if "rewards" in edit:
        config["model"].pop("rewards")
        if edit["rewards"] is not None:
            config["model"]["rewards"] = edit["rewards"]
    config["trainer"]["max_steps"] = edit.get("max_steps", config["trainer"]["max_steps"])
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_trl_class_through_gspo_fit_its_get_reward_and_environments_for_reward_functions(tmp_path):
    from gspo_lightning.cli import main

    main(["fit", "--config", counting_table_config(
        tmp_path, rewards=[{"function": "tests.test_trl_environments.reads_reward", "weight": 0.5}])])
    rows = logged(tmp_path)
    assert len(rows) == 2
    for row in rows:
        # each component logged under its name; the total is the weighted function plus get_reward
        assert 0 <= row["reward/CountingTable"] <= 1 and row["reward/reads_reward"] >= 0
        assert row["reward/mean"] == pytest.approx(0.5 * row["reward/reads_reward"] + row["reward/CountingTable"], abs=1e-5)


def test_a_trl_class_with_get_reward_needs_no_reward_functions(tmp_path):
    from gspo_lightning.cli import main

    main(["fit", "--config", counting_table_config(tmp_path, rewards=None, max_steps=1)])
    assert [row["reward/CountingTable"] == row["reward/mean"] for row in logged(tmp_path)] == [True]

