"""Prompts for rollouts: load, template, tokenize, and stream them endlessly and resumably.

Each training batch is ``rollout_batch_size`` prompts of one step (all ranks together);
the rollout callback turns it into ``num_return_sequences_in_group`` responses each. The
stream reshuffles every pass over the data, gives each rank a disjoint share, and can
restart at any batch, so a resumed run sees the prompts it would have seen.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Union

import lightning as L
from torch.utils.data import DataLoader, Sampler

from gspo_lightning.data.datasets import BUILTIN_FILES
from gspo_lightning.data.tasks import BUILTIN_DATASETS, BUILTIN_PREFIX
from gspo_lightning.data.verifiers import VerifiersTasks, verifiers_rows
from gspo_lightning.errors import ConfigError
from gspo_lightning.models.vision import ImageInputs, ImageRenderer, load_image_processor, load_images

log = logging.getLogger(__name__)


# the data path of a verifiers environment's tasks (model.episodes.verifiers)
VERIFIERS_PATH = "verifiers"

# the extra prompt stream (dynamic sampling) shuffles with data.seed + this
EXTRA_STREAM_SEED = 1_000_003


class DataError(ConfigError):
    """A data file or row cannot be used; the message names the file and line."""


def is_generated(path: str) -> bool:
    """Whether ``path`` names a synthetic task whose rows are drawn from a seed (``builtin:echo``)."""
    return path.startswith(BUILTIN_PREFIX) and path[len(BUILTIN_PREFIX):] in BUILTIN_DATASETS


def builtin_names() -> list[str]:
    """Every ``builtin:`` data set: the generated tasks and the files shipped in the package."""
    return sorted(BUILTIN_PREFIX + k for k in [*BUILTIN_DATASETS, *BUILTIN_FILES])


def resolve_path(path: str) -> Path:
    """The file or folder behind a data path: ``builtin:<name>`` for a file shipped in the
    package (``builtin:gsm8k``), else the path itself (relative to the working directory)."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_FILES:
            raise DataError(f"unknown builtin dataset {path!r}; choose one of {builtin_names()}")
        return BUILTIN_FILES[name]
    return Path(path).expanduser()


def read_rows(path: str, *, bad_rows: str = "error", num_builtin_rows: int = 20000, seed: int = 0) -> tuple[list[dict], int]:
    """Rows of a jsonl / json / parquet file, a saved ``datasets`` folder, or ``builtin:<name>``.

    Returns ``(rows, skipped)``; with ``bad_rows="error"`` a malformed jsonl line raises
    :class:`DataError` naming the file and line. A source with no rows is an error.
    """
    if is_generated(path):
        return BUILTIN_DATASETS[path[len(BUILTIN_PREFIX):]](num_builtin_rows, seed), 0
    p = resolve_path(path)
    if not p.exists():
        raise DataError(f"data path {str(p)!r} does not exist (relative paths start at the working directory "
                        f"{str(Path.cwd())!r}; builtin data: {builtin_names()})")
    rows, skipped = _read_source(p, bad_rows)
    if not rows:
        detail = f" ({skipped} malformed rows skipped)" if skipped else ""
        raise DataError(f"{p} has no rows{detail}: point the data path at a file with at least one row")
    return rows, skipped


def _read_source(p: Path, bad_rows: str) -> tuple[list[dict], int]:
    if p.is_dir():
        from datasets import load_from_disk

        dataset = load_from_disk(str(p))
        if hasattr(dataset, "keys"):  # a DatasetDict: take the train split
            if "train" not in dataset:
                raise DataError(f"{p} holds splits {list(dataset.keys())}; point at one split's folder")
            dataset = dataset["train"]
        return [dict(row) for row in dataset], 0
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist(), 0
    if p.suffix == ".json":
        rows = json.loads(p.read_text())
        if not isinstance(rows, list):
            raise DataError(f"{p}: a .json data file must hold a list of objects")
        return rows, 0
    if p.suffix not in (".jsonl", ".ndjson"):
        raise DataError(f"{p}: unsupported data format {p.suffix!r}; use .jsonl, .json, .parquet or a datasets folder")
    rows, skipped = [], 0
    with open(p) as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ConfigError(f"expected a JSON object, got {type(row).__name__}")
            except ValueError as err:
                if bad_rows == "error":
                    raise DataError(f"{p}:{line_no}: malformed row ({err}); fix it or set data.bad_rows=skip") from None
                skipped += 1
                continue
            rows.append(row)
    return rows, skipped


class EndlessBatchSampler(Sampler[list[int]]):
    """Batches of row indices forever: a fresh permutation per pass, this rank's share only.

    Batch ``b`` (counting from 0 over the whole run) is the same on every restart, so
    resuming only needs ``start_batch``.
    """

    def __init__(self, num_rows: int, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0, start_batch: int = 0):
        global_batch = batch_size * world_size
        if num_rows < global_batch:
            raise DataError(f"{num_rows} usable prompts cannot fill one step of {batch_size} prompts x {world_size} ranks")
        self.num_rows, self.batch_size = num_rows, batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.start_batch = shuffle, seed, start_batch
        self.batches_per_pass = num_rows // global_batch  # the remainder of a pass is dropped
        self._cached_order: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        # kept for the pass: shuffling every row at each step cost 5 ms at 20k rows and 0.5 s at 1M
        if self._cached_order is None or self._cached_order[0] != epoch:
            order = list(range(self.num_rows))
            if self.shuffle:
                random.Random(self.seed * 100003 + epoch).shuffle(order)
            self._cached_order = (epoch, order)
        return self._cached_order[1]

    def batch(self, index: int) -> list[int]:
        """This rank's row indices of batch ``index`` (counting from 0 over the whole run)."""
        epoch, within = divmod(index, self.batches_per_pass)
        start = within * self.batch_size * self.world_size + self.rank * self.batch_size
        return self._order(epoch)[start:start + self.batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        batch = self.start_batch
        while True:
            yield self.batch(batch)
            batch += 1


class PromptDataModule(L.LightningDataModule):
    """Prompts for GSPO rollouts.

    Args:
        path: training prompts: ``.jsonl`` / ``.json`` / ``.parquet`` file, a saved
            ``datasets`` folder, a file shipped with the package (``builtin:gsm8k``,
            ``builtin:gsm8k-heldout``) or a synthetic task (``builtin:echo``,
            ``builtin:successor``, ``builtin:alternate``). Relative paths start at the working
            directory. ``verifiers``: the tasks of the verifiers environment of ``model.episodes.verifiers``
            (its ``args``).
        val_path: held-out prompts for validation (same formats). ``None``: for a synthetic
            task, ``val_size`` fresh rows drawn with another seed; for a file, its last
            ``val_size`` rows, held out of training. ``verifiers``: the verifiers environment's tasks
            with its ``eval_args``.
        val_size: number of validation prompts (``None`` or 0 with no ``val_path``: no validation).
        test_path: prompts that ``gspo test`` scores (same formats; a synthetic task draws
            ``val_size`` rows with a third seed). ``gspo test`` without it is an error.
        tokenizer: the tokenizer that turns prompts into token ids: a hub id, a local folder
            or ``builtin:<name>``. The ``gspo`` command sets it to ``model.model_name_or_path``.
        prompt_field: the column holding the prompt: text, or a list of chat messages
            (``[{role, content}, ...]``, TRL's conversational format) rendered with the chat template.
        messages_field: a column of chat messages (``[{role, content}, ...]``); when set it
            is rendered with the tokenizer's chat template instead of ``prompt_field``.
        prompt_template: optional Python format string over the row's columns, e.g.
            ``"Question: {question}\\nAnswer:"``; applied before the chat template.
        use_chat_template: wrap the prompt as one user message with the chat template.
        system_prompt: a system message placed before the user message (chat template only).
        rollout_batch_size: prompts per training step over all ranks (ROLL's key).
        prompt_length: the longest prompt in tokens (ROLL's key).
        overlong_prompts: ``truncate_left`` keeps the end of a long prompt, ``truncate_right``
            its beginning, ``drop`` removes it; either way the count is logged.
        bad_rows: ``error`` stops at a malformed row naming file and line; ``skip`` skips
            and counts it (also rows missing the prompt column).
        shuffle: reshuffle the prompts on every pass.
        seed: seed of the shuffling and of builtin task rows.
        val_batch_size: prompts per validation (and test) batch.
        episodes: the model runs multi-turn episodes (``model.episodes``; the ``gspo`` command
            sets it), which render every prompt with the chat template and the tools themselves:
            ``use_chat_template`` is not consulted, and ``system_prompt`` is refused (a system
            message goes first in the environment's ``first_messages``).
        verifiers: the tasks of the verifiers environment of ``model.episodes.verifiers`` (the
            ``gspo`` command sets them), which ``path: verifiers`` reads.
        images_field: the column of a row's images, for a vision-language model: one image or a
            list (paths from the data file's folder, bytes, PIL images, ``{"bytes": ...}``). A text
            prompt gets one image part per image before its text; chat messages place their own
            ``{"type": "image"}`` parts. A row without the column is a text prompt.
    """

    def __init__(
        self,
        path: str = "builtin:echo",
        val_path: Optional[str] = None,
        val_size: Optional[int] = 64,
        test_path: Optional[str] = None,
        tokenizer: Optional[str] = None,
        prompt_field: str = "prompt",
        messages_field: Optional[str] = None,
        prompt_template: Optional[str] = None,
        use_chat_template: bool = False,
        system_prompt: Optional[str] = None,
        rollout_batch_size: int = 16,
        prompt_length: int = 512,
        overlong_prompts: Literal["truncate_left", "truncate_right", "drop"] = "truncate_left",
        bad_rows: Literal["error", "skip"] = "error",
        shuffle: bool = True,
        seed: int = 0,
        val_batch_size: int = 32,
        episodes: bool = False,
        verifiers: Optional[VerifiersTasks] = None,
        images_field: str = "images",
    ):
        super().__init__()
        if episodes and system_prompt:
            raise ConfigError("data.system_prompt is not used in multi-turn episodes (model.episodes renders each "
                             "prompt with the chat template and the tools itself): put the system message first in "
                             "the environment's first_messages (ToolEnvironment), or start the rows' chat messages "
                             "with it, and remove data.system_prompt")
        if rollout_batch_size < 1:
            raise ConfigError(f"data.rollout_batch_size must be >= 1, got {rollout_batch_size}")
        if prompt_length < 1:
            raise ConfigError(f"data.prompt_length must be >= 1, got {prompt_length}")
        self.save_hyperparameters()
        self.tokenizer = None  # loaded from hparams.tokenizer on first use, or set directly
        self.image_renderer: Optional[ImageRenderer] = None  # built on the first row with images
        self.train_rows: list[dict] = []
        self.val_rows: list[dict] = []
        self.test_rows: list[dict] = []
        self.stats: dict[str, float] = {}
        # rollout batches used by training steps: the resume position, counted here (not
        # read from the module) so the data module owns its own state
        self.batches_consumed = 0
        self.start_batch = 0
        self.train_sampler: Optional[EndlessBatchSampler] = None
        # the extra prompt stream of dynamic sampling (extra_batch): its own position, resumed too
        self.extra_batches_consumed = 0
        self._extra_batches: Optional[Iterator[list[int]]] = None

    # -- preparation -------------------------------------------------------------------
    def _get_tokenizer(self):
        if self.tokenizer is None and self.hparams.tokenizer is not None:
            from gspo_lightning.models.loading import load_tokenizer

            self.tokenizer = load_tokenizer(self.hparams.tokenizer)
        if self.tokenizer is None:
            raise ConfigError("PromptDataModule needs a tokenizer: set data.tokenizer to the model's name or folder "
                             "(the gspo command links it to model.model_name_or_path)")
        return self.tokenizer

    def raw_prompt(self, row: dict) -> Union[str, list[dict]]:
        """The prompt as reward functions see it: the row's messages (conversational), or
        its text after ``prompt_template``, before any chat template."""
        hp = self.hparams
        if hp.messages_field is not None:
            return _messages(row[hp.messages_field], hp.messages_field)
        if hp.prompt_template:
            return hp.prompt_template.format(**row)
        value = row[hp.prompt_field]
        if isinstance(value, list):  # TRL's conversational format: a prompt column of messages
            return _messages(value, hp.prompt_field)
        if not isinstance(value, str):
            raise TypeError(f"prompt column {hp.prompt_field!r} holds {type(value).__name__}, not text or messages")
        return value

    def _get_image_renderer(self) -> ImageRenderer:
        if self.image_renderer is None:
            if self.hparams.tokenizer is None:
                raise ConfigError("rows with images need the model's image processor: set data.tokenizer to the model "
                                  "(the gspo command links it to model.model_name_or_path)")
            self.image_renderer = ImageRenderer(self._get_tokenizer(), load_image_processor(self.hparams.tokenizer))
        return self.image_renderer

    def render(self, row: dict, num_images: int = 0) -> str:
        """The prompt text of a row (template and chat template applied); with ``num_images``,
        a text prompt gets that many image parts before its text."""
        hp = self.hparams
        tokenizer = self._get_tokenizer()
        prompt = self.raw_prompt(row)
        if num_images and isinstance(prompt, str):
            content = [*({"type": "image"} for _ in range(num_images)), {"type": "text", "text": prompt}]
            messages = [{"role": "user", "content": content}]
            if hp.system_prompt:
                messages.insert(0, {"role": "system", "content": hp.system_prompt})
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if isinstance(prompt, list):
            return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        if hp.use_chat_template and has_chat_template(tokenizer):  # without one: plain text, warned in _prepare
            messages = [{"role": "user", "content": prompt}]
            if hp.system_prompt:
                messages.insert(0, {"role": "system", "content": hp.system_prompt})
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return prompt

    def _prepare(self, rows: list[dict], source: str) -> tuple[list[dict], dict[str, int]]:
        hp = self.hparams
        tokenizer = self._get_tokenizer()
        if not hp.episodes and hp.messages_field is None and rows and not isinstance(rows[0].get(hp.prompt_field), list):
            warn_chat_template_mismatch(tokenizer, hp.use_chat_template, hp.tokenizer)  # text prompts only
        kept, counts = [], {"truncated": 0, "dropped": 0, "bad": 0}
        base_dir = None if source.startswith(BUILTIN_PREFIX) else resolve_path(source).parent  # of relative image paths
        rendered = []  # (row number, row, prompt, text, ids, image inputs) of the rows that render
        for index, row in enumerate(rows):
            ids = image_inputs = None
            try:
                prompt = self.raw_prompt(row)
                images = load_images(row.get(hp.images_field), base_dir)
                text = self.render(row, num_images=len(images))
                if images:  # each image token expanded to the image's patches
                    ids, image_inputs = self._get_image_renderer().render(text, images)
            except (KeyError, IndexError, TypeError, ValueError) as err:
                if hp.bad_rows == "error":
                    raise DataError(f"{source} row {index + 1}: cannot build a prompt ({type(err).__name__}: {err}); "
                                    f"check data.prompt_field / data.prompt_template / data.images_field, or set "
                                    f"data.bad_rows=skip") from None
                counts["bad"] += 1
                continue
            rendered.append((index, row, prompt, text, ids, image_inputs))
        # the text prompts tokenized in one call per chunk: half the time of a call per row (~0.5 s of
        # every run's start on 20k rows); the same ids
        texts = [(n, item[3]) for n, item in enumerate(rendered) if item[5] is None]
        text_ids = {}
        for start in range(0, len(texts), 4096):
            chunk = texts[start:start + 4096]
            encoded = tokenizer([text for _, text in chunk], add_special_tokens=False)["input_ids"]
            text_ids.update((n, list(ids)) for (n, _), ids in zip(chunk, encoded))
        for n, (index, row, prompt, text, ids, image_inputs) in enumerate(rendered):
            if image_inputs is None:
                ids = text_ids[n]
            elif len(ids) > hp.prompt_length:  # cutting an image's tokens would break it
                if hp.overlong_prompts != "drop" and hp.bad_rows == "error":
                    raise DataError(f"{source} row {index + 1}: the prompt with its images is {len(ids)} tokens, over "
                                    f"data.prompt_length={hp.prompt_length}, and a prompt with images cannot be cut: "
                                    f"raise data.prompt_length, or set data.overlong_prompts=drop")
                counts["dropped" if hp.overlong_prompts == "drop" else "bad"] += 1
                continue
            if not ids:
                if hp.bad_rows == "error":
                    raise DataError(f"{source} row {index + 1}: empty prompt; remove it or set data.bad_rows=skip")
                counts["bad"] += 1
                continue
            if len(ids) > hp.prompt_length:
                if hp.overlong_prompts == "drop":
                    counts["dropped"] += 1
                    continue
                counts["truncated"] += 1
                ids = ids[-hp.prompt_length:] if hp.overlong_prompts == "truncate_left" else ids[:hp.prompt_length]
                text = tokenizer.decode(ids)
            # a prompt's pixels are rendered again when its batch is built: kept for every row, they
            # would hold megabytes per image of a real dataset in memory for the whole run
            kept.append({"prompt_ids": ids, "prompt": prompt, "prompt_text": text, "row": row,
                         **({"image_dir": base_dir} if image_inputs is not None else {})})
        return kept, counts

    def setup(self, stage: str) -> None:
        hp = self.hparams
        if stage == "test":
            if not self.test_rows:
                self.test_rows = self._test_rows()
            return
        if self.train_rows or self.val_rows:
            return
        if hp.verifiers is not None and hp.path != VERIFIERS_PATH:
            raise DataError(f"model.episodes.verifiers runs its environment's own tasks, but data.path is {hp.path!r}: "
                            f"set data.path: {VERIFIERS_PATH}")
        rows, skipped = self._read(hp.path, "train", seed=hp.seed)
        if hp.val_path is not None:
            val_rows, _ = self._read(hp.val_path, "eval", seed=hp.seed + 1)
        elif is_generated(hp.path) and hp.val_size:
            val_rows, _ = read_rows(hp.path, num_builtin_rows=hp.val_size, seed=hp.seed + 7919)
        elif hp.val_size:
            # no held-out file: hold out the last val_size rows, never trained on
            if hp.val_size >= len(rows):
                raise DataError(f"val_size={hp.val_size} leaves no training prompts out of {len(rows)} rows in {hp.path}: "
                                f"lower data.val_size or set data.val_path")
            rows, val_rows = rows[:-hp.val_size], rows[-hp.val_size:]
        else:
            val_rows = []
        if hp.val_size is not None:
            val_rows = val_rows[:hp.val_size]
        self.val_rows, _ = self._prepare(val_rows, hp.val_path or hp.path)
        if stage == "fit":
            self.train_rows, counts = self._prepare(rows, hp.path)
            if not self.train_rows:
                raise DataError(f"no usable training prompts in {hp.path}: {counts}; check data.prompt_field and data.prompt_length")
            counts["bad"] += skipped
            self.stats = {f"data/train_prompts_{k}": float(v) for k, v in counts.items()}
            self.stats["data/train_prompts"] = float(len(self.train_rows))
            if any(counts.values()):
                log.warning("training prompts: %d kept, %s", len(self.train_rows), counts)

    def _read(self, path: str, split: str, seed: int) -> tuple[list[dict], int]:
        """``read_rows``, or the verifiers environment's tasks for ``path: verifiers``."""
        if path != VERIFIERS_PATH:
            return read_rows(path, bad_rows=self.hparams.bad_rows, seed=seed)
        settings = self.hparams.verifiers
        if settings is None:
            raise DataError(f"data path {VERIFIERS_PATH!r} reads the tasks of model.episodes.verifiers, which is not set: "
                            "set model.episodes.verifiers.id (or point the data path at a file)")
        if isinstance(settings, dict):  # as the hyperparameters keep it
            settings = VerifiersTasks(**settings)
        if split == "eval" and settings.eval_args is None:
            raise DataError("data.val_path: verifiers reads the held-out tasks with model.episodes.verifiers.eval_args, "
                            "which is not set: set it (e.g. {split: eval}), or leave data.val_path unset to hold out "
                            "the last data.val_size training tasks")
        return verifiers_rows(settings, split), 0

    def _test_rows(self) -> list[dict]:
        hp = self.hparams
        if hp.test_path is None:
            raise DataError("gspo test scores the prompts of data.test_path, and none is set: set data.test_path "
                            "to a held-out file (or run gspo validate to score the validation prompts)")
        rows, _ = read_rows(hp.test_path, bad_rows=hp.bad_rows, num_builtin_rows=hp.val_size or 64, seed=hp.seed + 2 * 7919)
        return self._prepare(rows, hp.test_path)[0]

    # -- loaders -----------------------------------------------------------------------
    def collate(self, items: list[dict]) -> dict[str, Any]:
        """One batch: token ids, raw prompts (text or messages), rendered text, other columns, and
        for prompts with images their model inputs (``images``; ``None`` for a text prompt)."""
        columns = {key: [item["row"].get(key) for item in items] for key in items[0]["row"]}
        batch = {
            "prompt_ids": [item["prompt_ids"] for item in items],
            "prompts": [item["prompt"] for item in items],
            "prompt_text": [item["prompt_text"] for item in items],
            "columns": columns,
        }
        if any("image_dir" in item for item in items):  # each prompt's image inputs (models/vision.py)
            batch["images"] = [self._image_inputs(item) if "image_dir" in item else None for item in items]
        return batch

    def _image_inputs(self, item: dict) -> ImageInputs:
        """The pixels of a prompt whose ids ``_prepare`` rendered (the same images, so the same ids)."""
        images = load_images(item["row"].get(self.hparams.images_field), item["image_dir"])
        ids, inputs = self._get_image_renderer().render(item["prompt_text"], images)
        if ids != item["prompt_ids"]:
            raise DataError(f"the images of prompt {item['prompt_text'][:60]!r} changed since the data was read "
                            f"({len(ids)} tokens, were {len(item['prompt_ids'])}): keep image files unchanged during a run")
        return inputs

    def _collate_train(self, items: list[dict]) -> dict[str, Any]:
        batch = self.collate(items)
        batch["stats"] = dict(self.stats)  # prompts kept / truncated / dropped / bad, logged with each step
        return batch

    def transfer_batch_to_device(self, batch: dict, device, dataloader_idx: int) -> dict:
        # prompts are python lists; the rollout layer puts tensors on the device itself
        return batch

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        # Lightning fetches one batch ahead; this hook runs only for the batch a step uses
        if self.trainer is not None and self.trainer.training:
            batch["index"] = self.batches_consumed  # its place in the stream (train_batch(index) gives it again)
            self.batches_consumed += 1
        return batch

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        world = self.trainer.world_size if self.trainer is not None else 1
        rank = self.trainer.global_rank if self.trainer is not None else 0
        if hp.rollout_batch_size % world != 0:
            raise ConfigError(f"data.rollout_batch_size={hp.rollout_batch_size} does not split evenly over {world} ranks; "
                             f"make it a multiple of {world}")
        self.batches_consumed = self.start_batch
        sampler = EndlessBatchSampler(
            len(self.train_rows), hp.rollout_batch_size // world, rank=rank, world_size=world,
            shuffle=hp.shuffle, seed=hp.seed, start_batch=self.start_batch,
        )
        self.train_sampler = sampler
        return DataLoader(self.train_rows, batch_sampler=sampler, collate_fn=self._collate_train)

    def train_batch(self, index: int) -> dict[str, Any]:
        """Training batch ``index`` of the stream, as the loader yields it at that step: lets
        an asynchronous run generate the next batches ahead without moving the resume position."""
        if self.train_sampler is None:
            self.train_dataloader()
        batch = self._collate_train([self.train_rows[i] for i in self.train_sampler.batch(index)])
        batch["index"] = index
        return batch

    def extra_batch(self) -> dict[str, Any]:
        """The next batch of the extra prompt stream: more prompts for a step that needs them
        (dynamic sampling). A second pass over the training prompts, shuffled with its own seed
        and sharded like the main stream; its position is part of :meth:`state_dict`."""
        if not self.train_rows:
            raise DataError("extra_batch() needs the training prompts: call setup('fit') first")
        if self._extra_batches is None:
            hp = self.hparams
            world = self.trainer.world_size if self.trainer is not None else 1
            rank = self.trainer.global_rank if self.trainer is not None else 0
            self._extra_batches = iter(EndlessBatchSampler(
                len(self.train_rows), hp.rollout_batch_size // world, rank=rank, world_size=world,
                shuffle=hp.shuffle, seed=hp.seed + EXTRA_STREAM_SEED, start_batch=self.extra_batches_consumed,
            ))
        indices = next(self._extra_batches)
        self.extra_batches_consumed += 1
        return self._collate_train([self.train_rows[i] for i in indices])

    def val_dataloader(self) -> DataLoader:
        if not self.val_rows:
            return []
        return DataLoader(self.val_rows, batch_size=self.hparams.val_batch_size, shuffle=False, collate_fn=self.collate)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_rows, batch_size=self.hparams.val_batch_size, shuffle=False, collate_fn=self.collate)

    # -- resume ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"batches_consumed": self.batches_consumed, "extra_batches_consumed": self.extra_batches_consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.start_batch = self.batches_consumed = int(state_dict.get("batches_consumed", 0))
        self.extra_batches_consumed = int(state_dict.get("extra_batches_consumed", 0))
        self._extra_batches = None  # restarts at the restored position


_WARNED: set[tuple[str, bool]] = set()


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def warn_chat_template_mismatch(tokenizer, use_chat_template: bool, name: Optional[str]) -> None:
    """Warn once when prompts are rendered unlike the model was tuned: an instruct model's chat
    template left unused, or ``use_chat_template`` asked of a tokenizer that has none."""
    from gspo_lightning.models.tiny import CHAT_TEMPLATE as TINY_TEMPLATE

    has_template = has_chat_template(tokenizer)
    if has_template == use_chat_template or tokenizer.chat_template == TINY_TEMPLATE:
        return  # the tiny builtin models carry a template for tests of the chat path, not from tuning
    model = name or getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    key = (str(model), use_chat_template)
    if key in _WARNED:
        return
    _WARNED.add(key)
    if has_template:
        log.warning("the tokenizer of %s has a chat template (an instruct or chat model), but data.use_chat_template is "
                    "false: prompts go in as raw text, which such a model answers worse; set data.use_chat_template: true",
                    model)
    else:
        log.warning("data.use_chat_template is true, but the tokenizer of %s has no chat template: prompts go in as "
                    "plain text; set data.use_chat_template: false, or use a tokenizer with a chat_template", model)


def _messages(value: Any, column: str) -> list[dict]:
    """A column cell that must be chat messages ``[{role, content}, ...]``."""
    if not (isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)):
        raise TypeError(f"column {column!r} must hold chat messages [{{role, content}}, ...], got {str(value)[:80]!r}")
    return value
