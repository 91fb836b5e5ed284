"""Loading the policy and its tokenizer: a hub id, a local folder, a GGUF file, or ``builtin:<name>``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch

from gspo_lightning.errors import ConfigError
from gspo_lightning.models.tiny import build_tiny_model, build_tokenizer, get_spec, is_builtin
from gspo_lightning.models.gguf import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what the hub accepts as a model id: "name" or "organization/name"
HUB_ID = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?$")
HUB_ID_EXAMPLE = "'Qwen/Qwen3-1.7B' (organization/name)"


def check_model_source(name_or_path: str) -> None:
    """Fail at once, in one line, for a local model folder that does not exist (instead of
    the hub's 'Repo id must be in the form ...' after a retry loop)."""
    if is_builtin(name_or_path):
        return
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"model path {name_or_path!r} is a file: point at the folder that holds config.json "
                                    f"(or at a .gguf file)")
        return
    looks_local = name_or_path.startswith((".", "/", "~", "\\")) or not HUB_ID.match(name_or_path) or ".." in name_or_path
    if looks_local:
        raise FileNotFoundError(f"model folder {name_or_path!r} does not exist ({path.resolve()}). A local model is a "
                                f"folder with config.json; a hub model is named by its id, like {HUB_ID_EXAMPLE}")
    from gspo_lightning.models.hub import go_offline, hub_reachable

    if hub_reachable() is False:  # a hub id without a network: the cache, or one error now (no retry loop)
        go_offline()


def _hub_error(name_or_path: str, err: OSError) -> FileNotFoundError:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return FileNotFoundError(f"cannot load model {name_or_path!r}: no local folder of that name "
                             f"({Path(name_or_path).expanduser().resolve()}) and the hub did not provide it: {first_line}. "
                             f"A hub id looks like {HUB_ID_EXAMPLE}; offline, point at a local folder")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The tokenizer of a model, left-padding, with a pad token.

    A tokenizer saved as a plain ``PreTrainedTokenizerFast`` is reloaded as that class:
    ``AutoTokenizer`` would otherwise pick the tokenizer class of the model's architecture
    (``Qwen2Tokenizer`` beside a qwen2 config) and silently change its pre-tokenizer.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    name_or_path = resolve_model(name_or_path)  # a GGUF source: its converted folder
    check_model_source(name_or_path)
    if is_builtin(name_or_path):
        tokenizer = build_tokenizer(get_spec(name_or_path))
    else:
        config_file = Path(name_or_path).expanduser() / "tokenizer_config.json"
        saved_class = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
        try:
            # transformers 5 saves a plain fast tokenizer as "TokenizersBackend"
            if saved_class in ("PreTrainedTokenizerFast", "TokenizersBackend"):
                tokenizer = PreTrainedTokenizerFast.from_pretrained(name_or_path)
            else:
                tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        except OSError as err:
            raise _hub_error(name_or_path, err) from err
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"tokenizer of {name_or_path!r} has neither a pad nor an end-of-sequence token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(
    name_or_path: str,
    tokenizer,
    dtype: str = "float32",
    attn_implementation: Optional[str] = None,
    trust_remote_code: bool = False,
):
    """The causal LM to train (a vision-language model's image-text-to-text class when its
    config has a vision tower). Weights load from safetensors when the checkpoint has them."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    name_or_path = resolve_model(name_or_path)  # a GGUF source: its converted folder
    if is_builtin(name_or_path):
        return build_tiny_model(name_or_path, tokenizer, DTYPES[dtype])
    check_model_source(name_or_path)
    kwargs = {"dtype": DTYPES[dtype], "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
        return auto.from_pretrained(name_or_path, **kwargs)
    except OSError as err:
        raise _hub_error(name_or_path, err) from err


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token that ends a response: the tokenizer's and the generation config's."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = getattr(model, "generation_config", None)
    extra = getattr(generation_config, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(int(i) for i in extra)
    if not ids:
        raise ConfigError("no end-of-sequence token: set eos_token on the tokenizer")
    return sorted(ids)
