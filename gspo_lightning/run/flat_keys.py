"""Old configs and command lines run unchanged: the flat ``model.*`` keys of earlier releases
(``model.clip_low``, ROLL's ``model.num_return_sequences_in_group``...) are rewritten into the
config blocks before the command parses them, with one line naming the new spelling.

What each flat key means is ``training/config.py``'s (:func:`nest_flat_keys`); this module only
finds them in ``--config`` files and ``--model.<key>`` arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from gspo_lightning.errors import ConfigError
from gspo_lightning.training.config import BLOCK_OF, OBJECTIVE_KEYS, nest_flat_keys, objective_spelling, rename_note


def translate_args(args: list[str]) -> tuple[list[str], Optional[str]]:
    """``args`` with flat keys in blocks, and the note to print (``None``: nothing was old)."""
    renames: list[tuple[str, str]] = []
    out: list[str] = []
    flat_objective: dict[str, str] = {}
    objective_at: Optional[int] = None
    index = 0
    while index < len(args):
        token = args[index]
        key, value, width = _split(args, index)
        index += width
        if key == "config" and value is not None and Path(value).is_file():
            translated, config_renames = _translate_config_file(Path(value))
            renames += config_renames
            out.append(f"--config={translated}" if translated is not None else token if width == 1 else f"--config={value}")
            continue
        if key is None or not key.startswith("model.") or value is None:
            out.extend(args[index - width:index])
            continue
        head, _, rest = key[len("model."):].partition(".")
        if head in BLOCK_OF:
            new = f"{BLOCK_OF[head]}.{head}" + (f".{rest}" if rest else "")
            out.append(f"--model.{new}={value}")
            renames.append((head, new))
        elif head in OBJECTIVE_KEYS and not rest:
            flat_objective[head] = value
            objective_at = len(out) if objective_at is None else objective_at
        else:
            out.extend(args[index - width:index])
    if flat_objective:
        out[objective_at:objective_at] = _objective_args(flat_objective)
        renames += [(key, objective_spelling(key)) for key in flat_objective]
    return out, rename_note(renames) if renames else None


def _split(args: list[str], index: int) -> tuple[Optional[str], Optional[str], int]:
    """``(key, value, tokens used)`` of the option at ``index`` (``--key=value`` or ``--key value``)."""
    token = args[index]
    if not token.startswith("--"):
        return None, None, 1
    if "=" in token:
        key, value = token[2:].split("=", 1)
        return key, value, 1
    if index + 1 < len(args) and not args[index + 1].startswith("--"):
        return token[2:], args[index + 1], 2
    return token[2:], None, 1


def _translate_config_file(path: Path) -> tuple[Optional[str], list[tuple[str, str]]]:
    """The file's content with its ``model:`` keys nested, as YAML text (``None``: nothing to change)."""
    config = yaml.safe_load(path.read_text())
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict) or not any(key in BLOCK_OF or key in OBJECTIVE_KEYS for key in model):
        return None, []
    config["model"], renames = nest_flat_keys(model)
    return yaml.safe_dump(config, sort_keys=False), renames


def _objective_args(flat: dict[str, str]) -> list[str]:
    """``--model.objective.policy_loss...`` arguments from the flat objective keys of a command line."""
    from gspo_lightning.objective.loss import OBJECTIVES

    args = []
    name = flat.get("policy_loss_type")
    if name is not None:
        cls = OBJECTIVES.get(name)
        if cls is None:
            raise ConfigError(f"model.policy_loss_type must be one of {', '.join(map(repr, OBJECTIVES))}; got {name!r}")
        args.append(f"--model.objective.policy_loss={cls.__module__}.{cls.__qualname__}")
    legacy = {key: arg for cls in OBJECTIVES.values() for key, arg in cls.LEGACY_KEYS.items()}
    for key in ("clip_low", "clip_high", "sapo_tau_pos", "sapo_tau_neg"):
        if key in flat:
            args.append(f"--model.objective.policy_loss.{legacy[key]}={flat[key]}")
    dual_on = flat.get("dual_clip_loss")
    if dual_on is not None:  # the dual clip acted only with dual_clip_loss: true, with dual_clip's value (3 by default)
        on = yaml.safe_load(dual_on) is True
        args.append(f"--model.objective.policy_loss.dual_clip={flat.get('dual_clip', 3.0) if on else 'null'}")
    return args


__all__ = ["translate_args"]
