"""A tiny LLM judge of the successor task, for the judge recipe (configs/judge_successor.yaml).

The judge is a causal language model like any other: it reads the chat message
``next 7 answer 8 3 8`` and replies ``1`` when the answer starts with the prompt's successor
(``8``), else ``0``. It is trained here by supervised fine-tuning on random answers until it
judges every (digit, first word) pair right, and saved as a Hugging Face folder that a stock
``vllm serve`` (or any OpenAI-compatible server) serves; the recipe's policy then learns from
its replies alone, through ``gspo_lightning.rewards.LLMJudge``.

    python -m gspo_lightning.data.tasks.successor_judge runs/successor_judge
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from gspo_lightning.models.tiny import build_tiny

MODEL = "builtin:tiny-successor-judge"
# what the recipe's LLMJudge sends (its kwargs.prompt): the task's prompt, then the policy's answer
JUDGE_PROMPT = "{prompt} answer {completion}"
ANSWER_WORDS = ["next", *[str(d) for d in range(10)]]  # what the policy can write


def verdict(digit: int, completion: str) -> str:
    """The judge's reply: "1" when the completion's first word is the successor of ``digit``."""
    words = completion.split()
    return "1" if words and words[0] == str((digit + 1) % 10) else "0"


def example(rng: random.Random) -> tuple[int, str]:
    """A prompt digit and an answer: half of them starting with its successor, the rest random."""
    digit = rng.randrange(10)
    words = [rng.choice(ANSWER_WORDS) for _ in range(rng.randrange(0, 7))]
    if words and rng.random() < 0.5:
        words[0] = str((digit + 1) % 10)
    return digit, " ".join(words)


def encode(tokenizer, digit: int, completion: str) -> tuple[list[int], int]:
    """The judge's conversation as the server renders it, its reply and end token; the reply's offset."""
    text = JUDGE_PROMPT.format(prompt=f"next {digit}", completion=completion)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    return ids + tokenizer(verdict(digit, completion), add_special_tokens=False).input_ids + [tokenizer.eos_token_id], len(ids)


def accuracy(model, tokenizer, seed: int = 1234, per_pair: int = 3) -> float:
    """Greedy replies right, over every (digit, first word) pair with random tails and the empty answer."""
    rng = random.Random(seed)
    cases = []
    for digit in range(10):
        cases.append((digit, ""))
        for first in ANSWER_WORDS:
            for _ in range(per_pair):
                cases.append((digit, " ".join([first] + [rng.choice(ANSWER_WORDS) for _ in range(rng.randrange(0, 6))])))
    right = 0
    with torch.no_grad():
        for digit, completion in cases:
            ids, start = encode(tokenizer, digit, completion)
            logits = model(torch.tensor([ids[:start]])).logits[0, -1]
            right += tokenizer.decode([int(logits.argmax())]).strip() == verdict(digit, completion)
    return right / len(cases)


def train(out: Path, seed: int = 0, max_steps: int = 3000, batch_size: int = 64, lr: float = 3e-4) -> float:
    """Train the judge until it judges every case right (checked every 100 steps); save it to ``out``."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, tokenizer = build_tiny(MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    score = 0.0
    for step in range(1, max_steps + 1):
        batch = [encode(tokenizer, *example(rng)) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for row, (ids, start) in enumerate(batch):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            labels[row, start:len(ids)] = torch.tensor(ids[start:])  # the loss on the reply and its end only
        loss = model(input_ids=input_ids, attention_mask=(input_ids != tokenizer.pad_token_id).long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            model.eval()
            score = accuracy(model, tokenizer)
            model.train()
            print(f"step {step}: loss {loss.item():.4f}, judged right {score:.3f}", flush=True)
            if score == 1.0:
                break
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return score


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to save the judge to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    score = train(args.out, seed=args.seed)
    print(f"judge saved to {args.out}: judges {score:.1%} of the check cases right")
    return 0 if score == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
