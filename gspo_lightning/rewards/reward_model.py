"""A sequence-classification reward model (one output: the score) as a reward function.

.. code-block:: yaml

    rewards:
      - function: gspo_lightning.rewards.RewardModel
        factory: true
        name: rm
        kwargs: {model_name_or_path: path/to/reward-model, batch_size: 16}

The folder (or hub id) loads with ``AutoModelForSequenceClassification`` and its own tokenizer;
prompt and completion go through that tokenizer's chat template as a conversation (a plain
concatenation when it has none). The model is frozen, in eval mode, on its own device, and
scores in batches; a batch gives the scores each sample gets alone (right padding: the last
real token of every row sees no padding).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch

from gspo_lightning.errors import ConfigError
from gspo_lightning.rewards.base import is_conversational

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NORMALIZATIONS = ("sigmoid",)


def default_device() -> str:
    """The trainer's device of this process: its rank's GPU where there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


class RewardModel:
    """Scores completions with a reward model.

    Args:
        model_name_or_path: a folder written by ``save_pretrained`` (or a hub id) of a
            sequence-classification model with one label.
        batch_size: samples per forward pass.
        device: where the model runs (default: this rank's GPU, else the CPU).
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        normalize: ``None``: the raw score; ``"sigmoid"``: mapped into 0-1 (to mix with 0-1
            rewards by weight; a Bradley-Terry model's score is a log-odds).
        max_length: longer inputs keep their last ``max_length`` tokens (where the score is read).
        trust_remote_code: for models whose code lives in their folder.
    """

    def __init__(
        self,
        model_name_or_path: str,
        *,
        batch_size: int = 16,
        device: Optional[str] = None,
        dtype: str = "float32",
        normalize: Optional[str] = None,
        max_length: Optional[int] = None,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if batch_size < 1:
            raise ConfigError(f"RewardModel batch_size must be >= 1, got {batch_size}")
        if dtype not in DTYPES:
            raise ConfigError(f"RewardModel dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if normalize is not None and normalize not in NORMALIZATIONS:
            raise ConfigError(f"RewardModel normalize must be null or one of {list(NORMALIZATIONS)}, got {normalize!r}")
        source = str(Path(model_name_or_path).expanduser()) if Path(model_name_or_path).expanduser().exists() \
            else model_name_or_path
        if source.startswith((".", "/", "~")) and not Path(source).is_dir():
            raise ConfigError(f"RewardModel: no folder {model_name_or_path!r}; give the folder a reward model was "
                              f"saved to (save_pretrained), or a hub id")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
            model = AutoModelForSequenceClassification.from_pretrained(
                source, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            raise ConfigError(f"RewardModel: cannot load {model_name_or_path!r} as a sequence-classification model "
                              f"({str(err).splitlines()[0]}); give a folder with its config, weights and tokenizer") from None
        if model.config.num_labels != 1:
            raise ConfigError(f"RewardModel: {model_name_or_path!r} has {model.config.num_labels} outputs; a reward "
                              f"model has one (num_labels=1)")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if model.config.pad_token_id is None:  # the model finds each row's last real token by it
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        self.device = torch.device(device or default_device())
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.batch_size = int(batch_size)
        self.normalize = normalize
        self.max_length = max_length

    def texts(self, prompts: list, completions: list) -> list[str]:
        """Each sample as the reward model reads it (:func:`conversation_text`)."""
        return [conversation_text(self.tokenizer, p, c) for p, c in zip(prompts, completions)]

    @torch.inference_mode()
    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        texts = self.texts(prompts, completions)
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            encoded = self.tokenizer(
                texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                truncation=self.max_length is not None, max_length=self.max_length,
                add_special_tokens=not self.tokenizer.chat_template,  # the template writes its own
            ).to(self.device)
            logits = self.model(**encoded).logits[:, 0].float()
            if self.normalize == "sigmoid":
                logits = torch.sigmoid(logits)
            scores.extend(logits.tolist())
        return scores


def conversation_text(tokenizer, prompt: Any, completion: Any) -> str:
    """A prompt and its completion as a reward model reads them: the conversation through the
    tokenizer's chat template, or the two texts joined when it has none. Train a reward model
    on these texts (tokenized without special tokens where there is a template) and it scores
    here what it learned on."""
    if not tokenizer.chat_template:
        return _text(prompt) + _text(completion)
    messages = list(prompt) if is_conversational(prompt) else [{"role": "user", "content": str(prompt)}]
    messages += list(completion) if is_conversational(completion) else [{"role": "assistant", "content": str(completion)}]
    return tokenizer.apply_chat_template(messages, tokenize=False)


def _text(value: Any) -> str:
    if is_conversational(value):
        return "".join(str(m.get("content") or "") for m in value)
    return str(value)
