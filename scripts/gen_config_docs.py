"""Write docs/config.md from the code: every key of the `model:` and `data:` sections with
its default and the docstring text, plus the defaults `gspo` sets for `trainer:` and
`checkpoint:`. tests/test_docs.py fails when the committed file is out of date.

    python scripts/gen_config_docs.py
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "config.md"

HEADER = """# Configuration reference

Generated from the code by `python scripts/gen_config_docs.py` (a test checks it is current).
A config file has the sections `seed_everything`, `trainer`, `checkpoint`, `model`, `data`;
any key can be overridden on the command line (`--model.clip_high=4e-4`), `--print_config`
prints the resolved config, and an unknown key is an error that names it.

Keys that carry the same name as in ROLL's GSPO configs keep ROLL's meaning:
`adv_estimator`, `importance_sampling`, `rollout_batch_size`, `num_return_sequences_in_group`,
`prompt_length`, `response_length`, `ppo_epochs`, `use_kl_loss`, `kl_loss_coef`,
`loss_agg_mode`, `whiten_advantages`, `advantage_clip`, `dual_clip_loss`, `reward_clip`,
`reward_norm`, `reward_shift`, `reward_scale`, `add_token_level_kl`.
"""


def parse_args_section(doc: str) -> dict[str, str]:
    """``Args:`` entries of a Google-style docstring: name -> one-line description."""
    lines = inspect.cleandoc(doc).splitlines()
    out, current, in_args = {}, None, False
    for line in lines:
        if line.strip() == "Args:":
            in_args = True
            continue
        if not in_args:
            continue
        if line and not line.startswith(" "):
            break
        match = re.match(r"^    (\w+(?:, \w+)*): (.*)$", line)
        if match:
            current = match.group(1).split(", ")
            for name in current:
                out[name] = match.group(2).strip()
        elif current and line.strip():
            for name in current:
                out[name] += " " + line.strip()
    return out


def format_default(value) -> str:
    if value is inspect.Parameter.empty:
        return "(required)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def section(title: str, cls) -> list[str]:
    params = [p for name, p in inspect.signature(cls.__init__).parameters.items() if name != "self"]
    docs = parse_args_section(cls.__doc__ or "")
    missing = [p.name for p in params if p.name not in docs]
    if missing:
        raise SystemExit(f"{cls.__name__} docstring lacks Args entries for: {missing}")
    rows = [f"## `{title}:` ({cls.__module__}.{cls.__name__})", "", "| key | default | meaning |", "|---|---|---|"]
    for p in params:
        meaning = docs[p.name].replace("|", "\\|")
        rows.append(f"| `{p.name}` | {format_default(p.default)} | {meaning} |")
    return rows + [""]


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from gspo_lightning.cli import TRAINER_DEFAULTS
    from gspo_lightning.data import PromptDataModule
    from gspo_lightning.module import GSPOModule

    parts = [HEADER]
    parts += section("model", GSPOModule)
    parts += section("data", PromptDataModule)
    parts += ["## `trainer:` (lightning.pytorch.Trainer)", "",
              "Every `Trainer` argument is a key (see Lightning's documentation). `gspo` changes these defaults:", "",
              "| key | default | why |", "|---|---|---|"]
    why = {
        "max_steps": "optimizer steps (a rollout batch makes `ppo_epochs x` its mini-batches of them)",
        "log_every_n_steps": "every step's metrics reach the loggers",
        "num_sanity_val_steps": "no generation before training starts",
        "use_distributed_sampler": "the prompt stream shards itself over ranks and resumes exactly",
    }
    for key, value in TRAINER_DEFAULTS.items():
        parts.append(f"| `{key}` | {format_default(value)} | {why[key]} |")
    parts += ["| `logger` | CSVLogger + TensorBoardLogger under `runs/` | metrics in standard formats |", "",
              "`val_check_interval` counts rollout batches (training batches), `max_steps` counts optimizer steps.", "",
              "## `checkpoint:` (lightning.pytorch.callbacks.ModelCheckpoint)", "",
              "Every `ModelCheckpoint` argument is a key. `gspo` sets `save_last: true`, `every_n_train_steps: 50`",
              "(optimizer steps; pick a multiple of the optimizer steps per rollout batch) and `save_top_k: 0`.",
              "SIGTERM and Ctrl-C also write `last.ckpt` at the next step boundary (see reliability.md).", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
