"""TRL's ``GRPOTrainer`` on the lookup task with its own tool loop: ``python _trl_tools_child.py CONFIG.json``.

The measurement ``bench_tools_trl.py`` runs against ``gspo fit --config configs/episodes_lookup_trl.yaml``:
``GRPOTrainer(environment_factory=LookupTable)`` on the folder ``gspo export-model --model
builtin:tiny-lookup`` wrote, on the CPU, GSPO as ours (``importance_sampling_level="sequence"``,
``loss_type="grpo"``, epsilon 3e-4 / 4e-4, beta 0), one optimizer step per generation batch, AdamW at
a constant learning rate, the task's two rewards at the recipe's weights (1 and 0.5).

The model folder is loaded as it is; two attributes of the tokenizer object are set here, in this
process, because TRL reads tool calls and renders tool turns through the tokenizer:

- ``response_template`` (transformers >= 5.13 response parsing, which TRL's ``parse_response`` calls):
  a turn whose first word is ``get`` is a tool call ``get(key=<next word>)``, as our ``WordCallParser``
  reads it; anything else is the turn's content. TRL's ``add_response_schema`` knows only the chat
  templates of the model families it ships (it raises ``Unrecognized chat template`` for this one).
- ``chat_template``: the tiny lookup template plus a branch for an assistant message with
  ``tool_calls``. TRL's ``supports_tool_calling`` rejects a template whose render of
  ``user -> assistant(tool_calls) -> tool`` lacks the tool's name, an argument's name or value, or the
  tool message (``GRPOTrainer.__init__``: "The provided chat template does not support tool
  calling"); the tiny template writes only ``content``. The branch writes ``get key=c``. It changes no
  token TRL trains on: TRL renders only the first user turn, then concatenates the sampled ids with the
  tool reply's ids, which come from ``_get_tool_suffix_ids`` (a dummy call with no arguments: the reply
  is ``tool: 7``, exactly as the tiny template renders it, and as ours appends it).

Our reward functions read an assistant turn's text (``get c``); TRL's parsed turn keeps a call in
``tool_calls`` with empty ``content``, so the rewards here see each call written back in the model's
words (``get c``) before scoring. The tool's reply text is ``str(get(key))`` on both sides.

Differences that stay (the trainers' own rules): TRL continues an episode after a turn cut at
``max_new_tokens`` (ours ends it, ``episode/ended_turn_tokens``); TRL's reply to a call that raises is
``{'error': ...}`` (``LookupTable.get`` never raises: an unknown key, ``get <eos>`` included, returns
``error``; ours replies ``error`` to a bare ``get`` too).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import warnings
from pathlib import Path

from _common import ChildResult, StepClock, peak_rss_mib, reset_peak_rss, rss_mib, versions

# `get c`: the first word names the tool, the next is its `key` (gspo_lightning.data.tasks.lookup.WordCallParser).
# The parser starts at the end of the prompt (the anchor is the end of the prefix TRL passes), so `^` is the
# turn's first character. The call's argument is its first word; what follows it, `<eos>` included, is dropped.
LOOKUP_RESPONSE_TEMPLATE = {
    "start_anchor_pattern": r"\Z",
    "defaults": {"role": "assistant"},
    "fields": {
        "tool_calls": {
            "open_pattern": r"^\s*(?P<name>get)\s+",
            "close_pattern": r"(?<=\S)(?:\s[\s\S]*)?\Z",
            "repeats": True,
            "content": "text",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": {"key": "{content}"}}},
        },
        "content": {"close_pattern": r"\s*<eos>[\s\S]*", "content": "text"},
    },
}
# models/tiny.py's LOOKUP_CHAT_TEMPLATE with one more branch: an assistant message with tool_calls (its newline an
# expression: transformers renders with trim_blocks, which drops a newline right after a block tag)
LOOKUP_TOOL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{% if message.tool_calls is defined and message.tool_calls %}{% for call in message.tool_calls %}"
    "{{ call['function']['name'] }}{% for k, v in call['function']['arguments'].items() %} {{ k }}={{ v }}{% endfor %}"
    "{% endfor %}{{ '\\n' }}{% else %}{{ message['content'] }}\n{% endif %}"
    "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}{% endfor %}"
)


def as_words(completion: list[dict]) -> list[dict]:
    """The episode's messages with each parsed call written back as the model wrote it (``get c``)."""
    out = []
    for message in completion:
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if calls:
            words = " ".join(" ".join([c["function"]["name"], *map(str, c["function"].get("arguments", {}).values())])
                             for c in calls)
            message = {**message, "content": " ".join(filter(None, [message.get("content") or "", words]))}
        out.append(message)
    return out


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    start = time.perf_counter()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch

    torch.set_num_threads(cfg["threads"])
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo_lightning.data.tasks.lookup import LookupTable, lookup_answer_reward, lookup_call_reward, make_rows

    result = ChildResult("trl", "lookup", versions=versions())
    n = cfg["prompts_per_step"] * cfg["group_size"]
    episodes: dict[str, list[float]] = {"turns": [], "multi_turn": [], "answer_reward": [], "call_reward": []}

    def scored(fn):
        @functools.wraps(fn)
        def reward(completions, **columns):
            completions = [as_words(c) for c in completions]
            scores = fn(completions, **columns)
            if fn is lookup_answer_reward:  # once per step: the shape of the episodes
                turns = [sum(m.get("role") == "assistant" for m in c) for c in completions]
                episodes["turns"].append(sum(turns) / len(turns))
                episodes["multi_turn"].append(sum(t > 1 for t in turns) / len(turns))
            episodes["answer_reward" if fn is lookup_answer_reward else "call_reward"].append(sum(scores) / len(scores))
            return scores
        return reward

    args = GRPOConfig(
        output_dir=cfg["out_dir"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=n,  # one micro-batch holds the whole generation batch, as ours
        gradient_accumulation_steps=1,
        steps_per_generation=1,  # one optimizer step per generation batch
        num_iterations=1,
        num_generations=cfg["group_size"],
        max_completion_length=cfg["response_length"],  # the whole episode: the model's and the tool's tokens
        max_tool_calling_iterations=cfg["max_turns"] - 1,  # assistant turns: the first and one after each reply
        generation_kwargs={"max_new_tokens": cfg["max_turn_tokens"]},  # one turn's tokens, as max_turn_tokens
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=cfg["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="grpo",
        importance_sampling_level="sequence",
        epsilon=3e-4,
        epsilon_high=4e-4,
        scale_rewards="group",
        reward_weights=cfg["reward_weights"],
        max_steps=cfg["steps"],
        seed=cfg["seed"],
        report_to="none",
        logging_steps=10**9,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    # The tokenizer trap (DESIGN.md): load the folder's tokenizer with the explicit class
    tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg["model_dir"])
    tokenizer.response_template = LOOKUP_RESPONSE_TEMPLATE
    tokenizer.chat_template = LOOKUP_TOOL_CHAT_TEMPLATE
    rows = make_rows(cfg["num_rows"], cfg["seed"])
    dataset = Dataset.from_list([{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows])

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            result.setup_s = time.perf_counter() - start
            result.baseline_rss_mib = rss_mib()
            result.load_peak_rss_mib = peak_rss_mib()
            result.peak_reset = reset_peak_rss()
            self.clock = StepClock()

        def on_step_end(self, args, state, control, **kwargs):
            self.clock.lap(result)
            metrics = trainer._metrics["train"]
            for key, name in (("reward", "reward_mean"), ("tools/call_frequency", "tool_calls"),
                              ("tools/failure_frequency", "tool_failures"), ("completions/mean_length", "model_tokens")):
                result.extra.setdefault(name, []).append(float(metrics[key][-1]) if metrics.get(key) else float("nan"))
            for key, values in episodes.items():
                result.extra.setdefault(key, []).append(values[-1] if values else float("nan"))
            self.clock.mark()

        def on_train_end(self, args, state, control, **kwargs):
            result.finish_memory()

    trainer = GRPOTrainer(model=cfg["model_dir"], reward_funcs=[scored(lookup_answer_reward), scored(lookup_call_reward)],
                          args=args, train_dataset=dataset, processing_class=tokenizer,
                          environment_factory=LookupTable, callbacks=[Probe()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    result.extra["global_step"] = trainer.state.global_step
    result.write(cfg["out_dir"])


if __name__ == "__main__":
    main(sys.argv[1])
