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
any key can be overridden on the command line (`--model.update.ppo_epochs=2`), `--print_config`
prints the resolved config, and an unknown key is an error that names it.

`model:` holds a few keys of its own and typed blocks, each checked beside its fields: `policy`,
`rollout`, `evaluation`, `advantages`, `objective` (with `objective.policy_loss`, one class per
objective: `gspo_lightning.objective.PPOClip`, `SAPO`, `CISPO`, `GMPO`, or your own subclass of
`gspo_lightning.objective.PolicyObjective`, chosen by `class_path`), `update` and `asynchronous`.
The flat keys of earlier releases (`model.response_length`, `model.clip_low`,
`model.policy_loss_type`, `model.dual_clip_loss`...) are still read, in config files and on the
command line, with the same meaning; the run prints one line naming their new spelling
(`training/config.py` maps them). Keys that carry the same name as in ROLL's GSPO configs keep
ROLL's meaning, flat or in their blocks:
`adv_estimator`, `importance_sampling`, `rollout_batch_size`, `num_return_sequences_in_group`,
`prompt_length`, `response_length`, `ppo_epochs`, `use_kl_loss`, `kl_loss_coef`,
`loss_agg_mode`, `whiten_advantages`, `advantage_clip`, `dual_clip_loss`, `reward_clip`,
`reward_norm`, `reward_shift`, `reward_scale`, `add_token_level_kl`.

Three keys are set from another one, so a value is stated once: `data.tokenizer` is
`model.model_name_or_path` (joined with `model.policy.gguf_file` when that is set), and `model.rollout.prompt_length` / `model.rollout.rollout_batch_size` are
`data.prompt_length` / `data.rollout_batch_size` (set those; the linked keys are not accepted).

A mistake in a config (a bad value, a missing model folder or data file, a failing reward
function) prints `gspo: error: <what is wrong and how to fix it>` and exits with status 2;
`--debug` (or `GSPO_DEBUG=1`) shows the traceback as well.
"""

REWARDS = """## Reward functions

`model.rewards` lists the reward functions; each entry has `function` (an import path),
`weight` (default 1), `kwargs` (bound to the function), `name` (its metric name, default
the function's name) and `factory` (`true`: `function(**kwargs)` returns the reward
function, as TRL's `get_soft_overlong_punishment` does). Scores are combined as the weighted
sum. Functions are called as TRL's `GRPOTrainer` calls them, so TRL's own
`trl.rewards.accuracy_reward` or `think_format_reward` run unchanged:

- every argument by keyword: `prompts`, `completions`, `completion_ids` (token ids of each
  completion), and every other column of the dataset row (e.g. `answer`), one entry per
  completion, plus `completion_lengths`; accept `**kwargs` for the columns you do not use;
- for a conversational dataset (a prompt column of chat messages, or `data.messages_field`)
  `prompts` holds the message lists and each completion is `[{"role": "assistant", "content": text}]`;
  otherwise both are plain strings;
- return one score per completion; `None` means "no score for this sample": the weighted sum
  skips it, and a sample that no function of non-zero weight scored (a weight-0 function is a
  monitor, logged only) gets advantage 0 and is left out of its
  group's and the batch's reward statistics (see docs/algorithm.md);
- `async def` functions are awaited, all of them concurrently.

A complete reward function, in `myrewards.py` in the directory you run `gspo` from (modules
there import like the script's own modules in `python script.py`):

```python
import re

def score(prompts, completions, answer, **kwargs):
    \"\"\"1.0 when the number after '####' equals the answer column's, None when there is no answer.\"\"\"
    scores = []
    for completion, reference in zip(completions, answer):
        if not reference:
            scores.append(None)  # nothing to compare with: no score for this sample
            continue
        found = re.search(r"####\\s*(-?[\\d,.]+)", completion)
        predicted = found.group(1).replace(",", "").rstrip(".") if found else None
        expected = reference.split("####")[-1].strip().replace(",", "")
        scores.append(1.0 if predicted == expected else 0.0)
    return scores
```

```yaml
model:
  rewards:
    - function: myrewards.score
    - function: gspo_lightning.rewards.format_reward
      weight: 0.1
      kwargs: {pattern: "(?s).*#### *-?[0-9][0-9,]*\\\\s*"}
```

A function that raises, returns the wrong number of scores, or a NaN stops the run with a
message naming it and the sample (`model.rollout.on_reward_error: zero` scores such samples 0 and
counts them instead). Built-ins: `gspo_lightning.rewards.math_accuracy`, `exact_match`,
`format_reward`, `length_penalty`, and the two below.

A reward function whose every sample of a step gets the same score (all 0, say), 20 steps in a
row, is named once on the console: it teaches nothing.

### Rewards from models: an LLM judge, a reward model

`gspo_lightning.rewards.LLMJudge` asks an LLM behind an OpenAI-compatible endpoint (a `vllm serve`
process, a hosted API) to score each completion; `gspo_lightning.rewards.RewardModel` scores
with a sequence-classification reward model (one output) from a folder or hub id. Both are
factories (`factory: true`): built once when the run starts, so an endpoint that does not
answer, a key it refuses, a model it does not serve or a reward-model folder that does not load
stops the run there, in one line. A judge over a GSM8K-style dataset (its `answer` column in the
prompt), beside a reward model scaled into 0-1:

```yaml
model:
  rewards:
    - function: gspo_lightning.rewards.LLMJudge
      factory: true
      name: judge
      kwargs:
        base_url: http://127.0.0.1:8000/v1
        model: judge
        api_key_env: JUDGE_API_KEY   # the variable holding the key, never the key itself
        prompt: |-
          Question: {prompt}
          Reference answer: {answer}
          Student answer: {completion}
          Grade the student answer from 0 to 10. Reply with the grade only.
        scale: [0, 10]
        max_concurrency: 8
        timeout_s: 60
    - function: gspo_lightning.rewards.RewardModel
      factory: true
      name: rm
      weight: 0.5
      kwargs: {model_name_or_path: path/to/reward-model, batch_size: 16, normalize: sigmoid}
```

The judge's prompt is a Python format string: `{prompt}`, `{completion}` (an episode: its
conversation as `role: content` lines) and any dataset column (a field no column provides stops
the first batch, naming it; a literal brace is written `{{` or `}}`). A reply without a score,
a score outside `scale`, or a request that fails after its retries leaves that sample
unscored (`None`, not 0): counted in `reward/<name>/failed`, and the first failure of each
kind (timeout, HTTP status, connection, no score) printed once. More than half of a step's samples
failing stops the run with a checkpoint and one line naming the endpoint, whatever
`on_reward_error` says. `group: true` sends each group (the responses to one prompt) in one
request, `{completions}` in place of `{completion}` (numbered `Response 1:` ...), and reads one
`Response <i>: <score>` line per response, as ART's RULER does; a reply that does not score
every response leaves the group unscored. Requests run concurrently, at most `max_concurrency`
in flight.

The reward model reads prompt and completion as a conversation through its own tokenizer's chat
template (plain text concatenated when it has none), in batches of `batch_size`, each score the
one the sample gets alone (right padding: the last real token sees no padding). It is frozen, in
eval mode, on `device` (default: the rank's GPU, else the CPU).
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
    params = [p for name, p in inspect.signature(cls.__init__).parameters.items()
              if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    docs = parse_args_section(cls.__doc__ or "")
    missing = [p.name for p in params if p.name not in docs]
    if missing:
        raise SystemExit(f"{cls.__name__} docstring lacks Args entries for: {missing}")
    rows = [f"## `{title}:` ({cls.__module__}.{cls.__name__})", "", "| key | default | meaning |", "|---|---|---|"]
    for p in params:
        meaning = docs[p.name].replace("|", "\\|")
        default = "its defaults below" if hasattr(p.default, "__dataclass_fields__") else format_default(p.default)
        rows.append(f"| `{p.name}` | {default} | {meaning} |")
    return rows + [""]


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from gspo_lightning.run.command import TRAINER_DEFAULTS
    from gspo_lightning.data.datamodule import PromptDataModule
    from gspo_lightning.training.module import GSPOModule
    from gspo_lightning.models.lora import LoRA
    from gspo_lightning.rollout import HFEngine

    parts = [HEADER]
    from gspo_lightning.training.config import BLOCKS
    from gspo_lightning.objective.loss import OBJECTIVES

    parts += section("model", GSPOModule)
    for name, block in BLOCKS.items():
        parts += section(f"model.{name}", block)
    for objective in OBJECTIVES.values():
        parts += section(f"model.objective.policy_loss: {objective.__name__}", objective)
    parts += section("model.lora", LoRA)  # the block that turns LoRA on (docs/lora.md)
    parts += section("model.engine.init_args", HFEngine)  # the default engine's keys
    parts += section("data", PromptDataModule)
    parts += ["## `trainer:` (lightning.pytorch.Trainer)", "",
              "Every `Trainer` argument is a key (see Lightning's documentation). `gspo` changes these defaults:", "",
              "| key | default | why |", "|---|---|---|"]
    why = {
        "max_steps": "rollout steps: one per rollout batch, which makes `ppo_epochs x` its mini-batches optimizer steps",
        "log_every_n_steps": "every step's metrics reach the loggers",
        "num_sanity_val_steps": "no generation before training starts",
        "use_distributed_sampler": "the prompt stream shards itself over ranks and resumes exactly",
    }
    for key, value in TRAINER_DEFAULTS.items():
        parts.append(f"| `{key}` | {format_default(value)} | {why[key]} |")
    parts += ["| `logger` | CSVLogger + TensorBoardLogger under `default_root_dir` | metrics in standard formats |", "",
              "`default_root_dir` is the run folder (`runs` when unset): a logger without a `save_dir` writes there",
              "(`<default_root_dir>/csv/version_N/`, `<default_root_dir>/tensorboard/version_N/`) and checkpoints go",
              "to the first logger's `version_N/checkpoints/`, so `--trainer.default_root_dir=DIR` moves them all.", "",
              "`--trainer.logger+=CLASS` adds a logger to CSV and TensorBoard: W&B, offline, with",
              "`--trainer.logger+=lightning.pytorch.loggers.WandbLogger --trainer.logger.init_args.offline=true`",
              "(`pip install -e \".[wandb]\"`; `wandb sync <run folder>/wandb/offline-run-*` uploads it later), or",
              "`lightning.pytorch.loggers.MLFlowLogger` (not tested here: mlflow is not installed in this project's",
              "environment). A logger left at the working directory (W&B's `save_dir: .`, MLflow's `./mlruns`) writes",
              "under the run folder instead. `--trainer.logger=CLASS` replaces CSV and TensorBoard: there is no",
              "`metrics.csv` then, and the run's own files (config.yaml, eval_results.jsonl, curves, hf_model/) go",
              "straight into the run folder, the checkpoints into `<run folder>/<name>/<version>/checkpoints/`.", "",
              "`max_steps`, `val_check_interval` and the checkpoint interval count rollout steps (the trainer's step",
              "counter advances once per rollout batch); the optimizer steps are logged as `policy_version`. Every",
              "file counts steps alike: the loggers' `step` (metrics.csv, TensorBoard), `eval_results.jsonl` and",
              "the checkpoints' `global_step` are the steps done; the evaluation of the untrained model",
              "(`num_sanity_val_steps: -1`) is step 0.", "",
              "Progress: in a terminal, a bar counting steps whose title names the phase of a slow step",
              "(`generating 64 responses, token 12/32`, `log-probs`, `update 2/4 optimizer steps`); without one",
              "(nohup, SLURM, a pipe), a plain line every tenth of `max_steps` or every 30 s, whichever comes",
              "first, and a line per phase once steps take longer than that",
              "(`--trainer.callbacks+=gspo_lightning.run.LineProgressBar --trainer.callbacks.every_n_steps=N",
              "--trainer.callbacks.interval_s=S` sets both). Each held-out evaluation is printed when measured, and",
              "the end of fit prints `held-out accuracy: untrained ... -> best ... -> last ...` with their steps.", "",
              "## `checkpoint:` (lightning.pytorch.callbacks.ModelCheckpoint)", "",
              "Every `ModelCheckpoint` argument is a key. `gspo` sets `save_last: true`, `every_n_train_steps: 50`",
              "(rollout steps), `save_top_k: 0` and `enable_version_counter: false`: `last.ckpt` is always the newest",
              "state of the run. It is also written at the end of fit, and a run resumed with `--ckpt_path last.ckpt`",
              "overwrites it (no `last-v1.ckpt`). SIGTERM and Ctrl-C write it within `--stop_grace_s` (default 10 s):",
              "a step still generating is abandoned, one in its update finishes it; a second signal stops at once",
              "(see reliability.md).",
              "`--trainer.enable_checkpointing=false` turns this section off: no checkpoints.", "",
              "`--export=best` (default `last`) keeps the weights of the best held-out evaluation (`val/accuracy`,",
              "the earliest of equal scores) as `best.ckpt` beside `last.ckpt` (weights only) and exports that",
              "policy to `hf_model/` at the end of fit, in place of the last step's.", "",
              "Disk: a checkpoint holds the policy's weights and the optimizer's state (AdamW: two more tensors per",
              "parameter), about three times the float32 weights: for SmolLM2-135M (134.5M parameters, 538 MB)",
              "`last.ckpt` is 1.6 GB, beside a 538 MB `hf_model/`. To keep less:",
              "`--checkpoint.save_weights_only=true` (a third of the size; it exports and evaluates, but a run",
              "cannot resume from it), `--checkpoint.every_n_train_steps=N` (fewer writes; `last.ckpt` is",
              "overwritten either way), `--checkpoint.monitor=step --checkpoint.mode=max --checkpoint.save_top_k=K`",
              "(the K newest as step-named files, beside `last.ckpt`), `--model.export_on_fit_end=false` (no",
              "`hf_model/`).", "", REWARDS]
    from gspo_lightning.rewards import LLMJudge, RewardModel

    parts += [line.replace("## `", "#### `", 1) for line in section("kwargs", LLMJudge)]
    parts += [line.replace("## `", "#### `", 1) for line in section("kwargs", RewardModel)]
    return "\n".join(parts)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
