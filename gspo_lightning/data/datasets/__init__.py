"""Data files shipped with the package, named ``builtin:<name>`` wherever a data path is accepted.

They are small (a GSM8K subset, MIT licence beside it) so that tests, the CPU configs and
the builtin tokenizers run from a plain clone or an installed wheel, with nothing outside it.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

# builtin:<name> -> the file it stands for
BUILTIN_FILES: dict[str, Path] = {
    "gsm8k": HERE / "gsm8k" / "train.jsonl",
    "gsm8k-heldout": HERE / "gsm8k" / "heldout.jsonl",
}

__all__ = ["BUILTIN_FILES"]
