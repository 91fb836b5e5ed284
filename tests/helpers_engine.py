"""Helpers of the Hugging Face engine tests: an engine started on a tiny model, prompts for the
tiny gsm8k model, and a generation laid out as the trainer sees it."""

from __future__ import annotations

import torch

from gspo_lightning.rollout.engine import EngineSpec
from gspo_lightning.rollout.hf import HFEngine, left_pad


def make_engine(model_tok, generation_batch_size=None):
    model, tok = model_tok
    engine = HFEngine(generation_batch_size=generation_batch_size)
    engine.start(EngineSpec(
        model_name_or_path="builtin:test", dtype="float32", prompt_length=None, response_length=16, seed=0,
        eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=model,
    ))
    return engine, tok


def prompts(tok, n=3):
    texts = ["Natalia sold clips", "How many", "A farmer has 12 cows and"][:n]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def rollout_batch(engine, tok, ps, n, params, seed):
    """``(generation, input_ids, attention_mask, prompt_width)`` as the trainer sees them."""
    gen = engine.generate(ps, n, params, seed=seed)
    ids, mask = left_pad([p for p in ps for _ in range(n)], tok.pad_token_id, "cpu")
    full = torch.cat([ids, gen.completion_ids], 1)
    attn = torch.cat([mask, gen.mask.long()], 1)
    return gen, full, attn, ids.shape[1]
