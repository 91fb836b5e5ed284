"""Helpers of the multi-turn episode tests, on the tiny lookup task: its token ids, scripted
turns, an engine that plays a script, the environment that replies to every first turn, and
``gspo fit`` configs of the lookup recipe with what their runs log."""

from __future__ import annotations

import csv
from pathlib import Path

import yaml

from gspo_lightning.data.tasks.lookup import LookupEnvironment
from gspo_lightning.episodes.messages import StepResult
from gspo_lightning.rollout.engine import Generation, RolloutEngine

ROOT = Path(__file__).resolve().parents[1]
# tiny-lookup's ids: <pad> 0, <eos> 1, <unk> 2, then tiny.LOOKUP_WORDS in order
PAD, EOS, USER, TOOL, FIND, GET = 0, 1, 3, 5, 6, 7
KEY = {k: 9 + i for i, k in enumerate("abcdef")}
DIGIT = {d: 15 + d for d in range(10)}

ROW = {"prompt": "find c", "key": "c", "table": "1 2 3 4 5 6", "answer": "3"}
CALL = ([GET, KEY["c"], EOS], [-0.1, -0.2, -0.3])
GUESS = ([DIGIT[5], EOS], [-0.6, -0.7])
ANSWER = ([DIGIT[3], EOS], [-0.4, -0.5])
REPLY = [TOOL, DIGIT[3]]  # "\ntool: 3\n" after the turn's <eos> (tiny-lookup's generation prompt is empty)


class ScriptedEngine(RolloutEngine):
    """Returns scripted responses, one list of (ids, logprobs) per call; records the prompts."""

    shares_policy_weights = True

    def __init__(self, script):
        super().__init__()
        self.script = list(script)
        self.calls = []

    def start(self, spec):
        pass

    def generate(self, prompt_ids, n, params, seed):
        self.calls.append({"prompts": [list(p) for p in prompt_ids], "n": n, "max_new_tokens": params.max_new_tokens,
                           "seed": seed})
        rows = self.script.pop(0)
        assert len(rows) == len(prompt_ids) * n
        truncated = [EOS not in ids for ids, _ in rows]
        return Generation.from_lists([ids for ids, _ in rows], [lps for _, lps in rows], truncated, PAD)


class RepliesToEveryTurn(LookupEnvironment):
    """The lookup environment, but a first turn that is no call gets the row's answer as a tool
    reply too, and the second turn ends the episode: random weights rarely call ``get``, and these
    tests need multi-turn episodes (environment tokens inside the sequence) from the first step."""

    def reset(self, row: dict, prompt: list[dict]) -> list[dict]:
        self.answer, self.turns = str(row["answer"]), 0
        return super().reset(row, prompt)

    def step(self, assistant_message: dict) -> StepResult:
        self.turns += 1
        if self.turns >= 2:
            return StepResult(messages=[], done=True)
        result = super().step(assistant_message)
        if result.done:
            return StepResult(messages=[{"role": "tool", "name": "get", "content": self.answer}])
        return result


def lookup_config(folder: Path, **model) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "episodes_lookup.yaml").read_text())
    config["trainer"].update({"max_steps": 2, "default_root_dir": str(folder), "val_check_interval": 2,
                              "num_sanity_val_steps": 0, "enable_progress_bar": False})
    config["data"].update({"val_size": 8, "rollout_batch_size": 4})
    config["model"].update({"num_return_sequences_in_group": 4, "mini_batch_size": 8, "export_on_fit_end": False, **model})
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def logged(folder: Path) -> list[dict]:
    rows = []
    for file in sorted(folder.glob("csv/version_*/metrics.csv")):
        rows += [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(open(file)) if r.get("reward/mean")]
    return rows


_failures = {"environment_steps": 0, "engine_calls": 0, "environment_resets": 0}


class FailsOnceEnvironment(LookupEnvironment):
    """The lookup environment, raising once: at its 20th step() of the process (in the second
    step of a 4 x 4 lookup run), as a sandbox that goes away would."""

    def step(self, assistant_message: dict) -> StepResult:
        _failures["environment_steps"] += 1
        if _failures["environment_steps"] == 20:
            raise ConnectionError("the sandbox went away")
        return super().step(assistant_message)


class ResetFailsOnceEnvironment(LookupEnvironment):
    """The lookup environment with an async start that fails once: its 20th ``areset`` of the
    process (in the second step of a 4 x 4 lookup run), as a server refusing a session would."""

    async def areset(self, row: dict, prompt: list[dict]) -> list[dict]:
        _failures["environment_resets"] += 1
        if _failures["environment_resets"] == 20:
            raise ConnectionError("the environment server refused the session")
        return self.reset(row, prompt)


class FailsOnceEngine(RolloutEngine):
    """The Hugging Face engine, raising once, at its 3rd generate of the process (the second step)."""

    def __init__(self):
        super().__init__()
        from gspo_lightning.rollout.hf import HFEngine

        self.inner = HFEngine()
        self.shares_policy_weights = True

    def start(self, spec):
        self.inner.start(spec)

    def generate(self, prompt_ids, n, params, seed):
        _failures["engine_calls"] += 1
        if _failures["engine_calls"] == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.inner.generate(prompt_ids, n, params, seed)
