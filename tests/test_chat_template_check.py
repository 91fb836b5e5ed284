"""A chat model's template left unused, or a template asked of a tokenizer without one: warned once."""

import copy
import logging

import pytest

from gspo_lightning.data import datamodule as data_module
from gspo_lightning.data.datamodule import PromptDataModule

INSTRUCT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(data_module, "_WARNED", set(), raising=False)


def setup_data(tokenizer, name, **kwargs):
    dm = PromptDataModule(path="builtin:echo", tokenizer=name, rollout_batch_size=2, prompt_length=64, val_size=4, **kwargs)
    dm.tokenizer = tokenizer
    dm.setup("fit")
    return dm


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]


def test_a_chat_model_without_its_template_is_warned_once(tiny_echo, caplog):
    tokenizer = copy.deepcopy(tiny_echo[1])
    tokenizer.chat_template = INSTRUCT_TEMPLATE
    with caplog.at_level(logging.WARNING, logger="gspo_lightning.data"):
        setup_data(tokenizer, "my-instruct-model")
        setup_data(tokenizer, "my-instruct-model")  # a second data module, a validate run: no repeat
    [message] = warnings_of(caplog)
    assert "my-instruct-model" in message and "set data.use_chat_template: true" in message


def test_a_template_asked_of_a_tokenizer_without_one_falls_back_to_text(tiny_echo, caplog):
    tokenizer = copy.deepcopy(tiny_echo[1])
    tokenizer.chat_template = None
    with caplog.at_level(logging.WARNING, logger="gspo_lightning.data"):
        dm = setup_data(tokenizer, "my-base-model", use_chat_template=True)
    [message] = warnings_of(caplog)
    assert "my-base-model has no chat template" in message and "set data.use_chat_template: false" in message
    row = dm.train_rows[0]
    assert row["prompt_text"] == row["prompt"]  # plain text, not an error per row


def test_no_warning_when_template_and_setting_agree(tiny_echo, caplog):
    tokenizer = copy.deepcopy(tiny_echo[1])
    tokenizer.chat_template = INSTRUCT_TEMPLATE
    with caplog.at_level(logging.WARNING, logger="gspo_lightning.data"):
        dm = setup_data(tokenizer, "my-instruct-model", use_chat_template=True)
        setup_data(tiny_echo[1], "builtin:tiny-echo")  # the tiny models' template is for tests only
    assert warnings_of(caplog) == []
    assert dm.train_rows[0]["prompt_text"].startswith("<|im_start|>user\n")


def test_episode_runs_render_prompts_themselves_so_the_setting_is_not_warned_about(tiny_echo, caplog):
    """Multi-turn episodes always render with the chat template (and the tools): the data
    module's use_chat_template is not theirs to follow, and a warning about it would mislead."""
    tokenizer = copy.deepcopy(tiny_echo[1])
    tokenizer.chat_template = INSTRUCT_TEMPLATE
    with caplog.at_level(logging.WARNING, logger="gspo_lightning.data"):
        setup_data(tokenizer, "my-instruct-model", episodes=True)
    assert warnings_of(caplog) == []


def test_a_system_prompt_in_an_episode_run_is_refused_naming_where_it_goes():
    with pytest.raises(ValueError, match="system_prompt is not used in multi-turn episodes.*first_messages"):
        PromptDataModule(path="builtin:echo", system_prompt="Be brief.", episodes=True)


@pytest.mark.parametrize("config, episodes", [("episodes_lookup.yaml", True), ("smollm2_tools_cpu.yaml", True),
                                               ("quickstart.yaml", False), ("smollm2_cpu.yaml", False)])
def test_the_gspo_command_tells_the_data_module_when_the_model_runs_episodes(config, episodes):
    from pathlib import Path

    from gspo_lightning.run.command import GSPOCLI
    from gspo_lightning.training.module import GSPOModule

    class ParseOnly(GSPOCLI):
        def instantiate_classes(self) -> None:  # parsing only: the models stay unloaded
            pass

    path = Path(__file__).resolve().parents[1] / "configs" / config
    cli = ParseOnly(GSPOModule, PromptDataModule, run=False, args=["--config", str(path)], auto_configure_optimizers=False)
    assert cli.config.data.episodes is episodes
