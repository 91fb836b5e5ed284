"""Config mistakes as one line: an unknown key names the closest valid one.

jsonargparse answers a misspelled key with the whole usage (well over a hundred lines) and
then the error; :class:`GSPOArgumentParser` raises :class:`UsageError` instead, which the
``gspo`` command prints as ``gspo: error: ...`` with the closest key it knows::

    gspo: error: unknown key model.clip_hihg: did you mean model.clip_high? (gspo fit --help lists the keys)
"""

from __future__ import annotations

import difflib
import re
from typing import Optional

from lightning.pytorch.cli import LightningArgumentParser

# the key out of jsonargparse's messages for an unknown key (from the command line, from a config file)
UNKNOWN = [
    re.compile(r"unrecognized arguments: .*?--([\w.@\-]+)"),
    re.compile(r"does not accept (?:option|key) '([\w.@\-]+)'"),
    re.compile(r'Key "([\w.@\-]+)" is not expected'),
    re.compile(r"No action for key \"([\w.@\-]+)\""),
]


class UsageError(Exception):
    """A command line or config the parser refused, with the parser that refused it."""

    def __init__(self, message: str, parser=None) -> None:
        super().__init__(message)
        self.parser = parser


class GSPOArgumentParser(LightningArgumentParser):
    """Raises :class:`UsageError` where jsonargparse would print the usage and exit."""

    def error(self, message: str, ex: Optional[Exception] = None):
        from jsonargparse._common import debug_mode_active

        if not self.exit_on_error or debug_mode_active():  # a parser inside jsonargparse's own attempts
            return super().error(message, ex)
        raise UsageError(message, getattr(ex, "subcommand_parser", None) or self) from ex


def known_keys(parser) -> list[str]:
    keys = []
    for action in getattr(parser, "_actions", []):
        dest = getattr(action, "dest", None)
        if dest and dest not in ("help", "config", "print_config") and not dest.startswith("=="):
            keys.append(dest)
    return keys


def closest_key(key: str, keys: list[str]) -> Optional[str]:
    """The valid key ``key`` most likely meant: same name in another section first (``--clip_high``
    means ``model.clip_high``), else the closest spelling, else the closest last part."""
    last = key.rsplit(".", 1)[-1]
    same_name = [k for k in keys if k.rsplit(".", 1)[-1] == last]
    if same_name:
        return same_name[0]
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    if match:
        return match[0]
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    in_section = [k for k in keys if k.startswith(section)] or keys
    names = {k.rsplit(".", 1)[-1]: k for k in in_section}
    match = difflib.get_close_matches(last, list(names), n=1, cutoff=0.6)
    return names[match[0]] if match else None


def flat_model_keys() -> list[str]:
    """The flat ``model.*`` keys of earlier releases: still accepted (``run/flat_keys.py``), so a
    misspelling of one is answered with it."""
    from gspo_lightning.training.config import BLOCK_OF, OBJECTIVE_KEYS

    return [f"model.{key}" for key in (*BLOCK_OF, *OBJECTIVE_KEYS)]


def short_message(err: UsageError, command: str = "fit") -> str:
    """One line for a refused command line: the unknown key and the closest valid one, or the
    parser's own message with its lines joined."""
    message = str(err)
    for pattern in UNKNOWN:
        found = pattern.search(message)
        if found:
            key = found.group(1).split("=", 1)[0]
            suggestion = closest_key(key, known_keys(err.parser) + flat_model_keys())
            hint = f": did you mean {suggestion}?" if suggestion else ""
            return f"unknown key {key}{hint} (gspo {command} --help lists the keys)"
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


__all__ = ["GSPOArgumentParser", "UsageError", "closest_key", "short_message"]
