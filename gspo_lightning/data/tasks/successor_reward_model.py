"""A tiny reward model of the successor task, for the reward-model recipe
(configs/reward_model_successor.yaml).

A sequence-classification model (one output) trained the way reward models are, from
preference pairs (Bradley-Terry: ``-log sigmoid(r_chosen - r_rejected)``): two answers to one
prompt, the preferred one holding more copies of the prompt's successor among its first four
words. It never sees a score, only which of two answers is better; the recipe's policy then
learns from its scores alone, through ``gspo_lightning.rewards.RewardModel``.

    python -m gspo_lightning.data.tasks.successor_reward_model runs/successor_rm
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from gspo_lightning.data.tasks.successor import REPEATS, successor_reward
from gspo_lightning.models.tiny import TINY_MODELS, build_config, build_tokenizer
from gspo_lightning.rewards.reward_model import conversation_text

ANSWER_WORDS = ["next", *[str(d) for d in range(10)]]


def answer(rng: random.Random, digit: int) -> str:
    """0-6 words, each a repeated word with a random share, else a random word; the repeated word
    is the successor half the time, another digit otherwise (so that repeating a digit is not
    what makes an answer better: which digit is)."""
    share = rng.random()
    successor = str((digit + 1) % 10)
    repeated = successor if rng.random() < 0.5 else rng.choice([d for d in ANSWER_WORDS[1:] if d != successor])
    return " ".join(repeated if rng.random() < share else rng.choice(ANSWER_WORDS) for _ in range(rng.randrange(0, 7)))


def true_score(digit: int, text: str) -> float:
    return successor_reward([f"next {digit}"], [text], [str((digit + 1) % 10)])[0]


def edited(rng: random.Random, text: str) -> str:
    """``text`` with one of its first words replaced: a near miss (or a near hit) of it."""
    words = text.split() or [rng.choice(ANSWER_WORDS)]
    words[rng.randrange(min(len(words), REPEATS))] = rng.choice(ANSWER_WORDS)
    return " ".join(words)


def pair(rng: random.Random) -> tuple[str, str, str]:
    """``(prompt, chosen, rejected)``: two answers whose true scores differ; half of the pairs
    one word apart, so that one more copy of the successor counts even among good answers."""
    digit = rng.randrange(10)
    while True:
        a = answer(rng, digit)
        b = edited(rng, a) if rng.random() < 0.5 else answer(rng, digit)
        sa, sb = true_score(digit, a), true_score(digit, b)
        if sa != sb:
            return (f"next {digit}", a, b) if sa > sb else (f"next {digit}", b, a)


def build(seed: int):
    """``(model, tokenizer)``: the quickstart's tokenizer and shape, one output."""
    from transformers import AutoModelForSequenceClassification

    spec = TINY_MODELS["tiny-successor"]
    tokenizer = build_tokenizer(spec)
    tokenizer.padding_side = "right"  # as RewardModel scores: the last real token sees no padding
    config = build_config(spec, tokenizer)
    config.num_labels = 1
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config), tokenizer


def scores(model, tokenizer, prompts: list[str], answers: list[str]) -> torch.Tensor:
    texts = [conversation_text(tokenizer, p, a) for p, a in zip(prompts, answers)]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return model(**encoded).logits[:, 0]


def pair_accuracy(model, tokenizer, seed: int = 1234, count: int = 500) -> float:
    """The share of fresh pairs the model orders right."""
    rng = random.Random(seed)
    pairs = [pair(rng) for _ in range(count)]
    with torch.no_grad():
        chosen = scores(model, tokenizer, [p for p, _, _ in pairs], [c for _, c, _ in pairs])
        rejected = scores(model, tokenizer, [p for p, _, _ in pairs], [r for _, _, r in pairs])
    return float((chosen > rejected).float().mean())


def train(out: Path, seed: int = 0, max_steps: int = 3000, batch_size: int = 64, lr: float = 1e-3,
          target: float = 0.995) -> float:
    """Train on fresh pairs until ``target`` of held-out pairs are ordered right; save to ``out``."""
    rng = random.Random(seed)
    model, tokenizer = build(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    accuracy = 0.0
    for step in range(1, max_steps + 1):
        pairs = [pair(rng) for _ in range(batch_size)]
        prompts = [p for p, _, _ in pairs]
        margin = scores(model, tokenizer, prompts, [c for _, c, _ in pairs]) - \
            scores(model, tokenizer, prompts, [r for _, _, r in pairs])
        loss = -torch.nn.functional.logsigmoid(margin).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            model.eval()
            accuracy = pair_accuracy(model, tokenizer)
            model.train()
            print(f"step {step}: loss {loss.item():.4f}, held-out pairs ordered right {accuracy:.3f}", flush=True)
            if accuracy >= target:
                break
    model.eval()
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return accuracy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to save the reward model to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    accuracy = train(args.out, seed=args.seed)
    print(f"reward model saved to {args.out}: orders {accuracy:.1%} of held-out pairs right "
          f"(the better answer: more of the first {REPEATS} words the successor)")
    return 0 if accuracy >= 0.99 else 1


if __name__ == "__main__":
    sys.exit(main())
