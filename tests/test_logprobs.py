"""The chunked log-prob path gives the naive path's values and gradients."""

import pytest
import torch

from gspo_lightning.logprobs import response_logprobs, supports_chunked


def batch(tok, vocab, rows=4, prompt=5, response=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :2] = 0  # left padding of a shorter prompt
    attn[1, prompt + 4:] = 0  # a shorter response
    return ids, attn, prompt


@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_equals_naive_values_and_gradients(tiny_gsm8k, chunk_size, temperature):
    model, tok = tiny_gsm8k
    assert supports_chunked(model)
    ids, attn, prompt = batch(tok, len(tok))
    weights = torch.randn(ids.shape[0], ids.shape[1] - prompt, generator=torch.Generator().manual_seed(1))

    def run(chunk):
        model.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(model, ids, attn, prompt, temperature=temperature, chunk_size=chunk)
        (lp * weights).sum().backward()
        return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    naive_lp, naive_ent, naive_grads = run(None)
    lp, ent, grads = run(chunk_size)
    torch.testing.assert_close(lp, naive_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, naive_ent, atol=1e-5, rtol=1e-5)
    assert naive_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], naive_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_logprobs_are_log_softmax_of_the_logits_by_hand(tiny_echo):
    model, tok = tiny_echo
    ids = torch.tensor([[3, 5, 6, 7]])
    attn = torch.ones_like(ids)
    lp, ent = response_logprobs(model, ids, attn, 2, chunk_size=2)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    expected = [torch.log_softmax(logits[t], -1)[ids[0, t + 1]] for t in (1, 2)]
    torch.testing.assert_close(lp[0], torch.stack(expected).detach(), atol=1e-5, rtol=1e-5)
    p = torch.softmax(logits[1], -1)
    torch.testing.assert_close(ent[0, 0], -(p * p.log()).sum(), atol=1e-5, rtol=1e-5)


def test_models_with_logit_softcapping_take_the_naive_path(tiny_echo):
    model, _ = tiny_echo
    model.config.final_logit_softcapping = 30.0
    try:
        assert not supports_chunked(model)
    finally:
        model.config.final_logit_softcapping = None
