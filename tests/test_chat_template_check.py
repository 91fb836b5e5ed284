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
