"""Log-probs under the sampling distribution; the chunked path gives the naive path's
values and gradients."""

import math

import pytest
import torch

from gspo_lightning.training.logprobs import head_logprobs, response_logprobs, supports_chunked, token_logprobs


def batch(tok, vocab, rows=4, prompt=5, response=7, seed=0, group=1):
    """``rows`` responses; with ``group > 1`` consecutive rows share their prompt, as a rollout's do."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=g)
    attn = torch.ones_like(ids)
    ids[:, :prompt] = ids[::group, :prompt].repeat_interleave(group, 0)
    attn[:group, :2] = 0  # left padding of a shorter prompt
    attn[1, prompt + 4:] = 0  # a shorter response
    return ids, attn, prompt


@pytest.mark.parametrize("chunk_size,max_unchunked_bytes", [(1, 0), (5, 0), (1024, 0), (5, 2**30)])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (0.8, 30, 0.9)])
@pytest.mark.parametrize("group", [1, 3])
def test_chunked_equals_naive_values_and_gradients(tiny_gsm8k, chunk_size, max_unchunked_bytes, temperature, top_k, top_p, group):
    """Chunked and checkpointed (budget 0), or in one piece (large budget), with prompts
    shared by groups of rows (one prompt pass per group) or not: the same values and
    gradients as the plain ``model.forward`` path over every row."""
    model, tok = tiny_gsm8k
    assert supports_chunked(model)
    ids, attn, prompt = batch(tok, len(tok), rows=6, group=group)
    weights = torch.randn(ids.shape[0], ids.shape[1] - prompt, generator=torch.Generator().manual_seed(1))

    def run(chunk):
        model.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(model, ids, attn, prompt, temperature=temperature, top_k=top_k, top_p=top_p,
                                    chunk_size=chunk, max_unchunked_bytes=max_unchunked_bytes)
        (lp * weights).sum().backward()
        return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    naive_lp, naive_ent, naive_grads = run(None)
    lp, ent, grads = run(chunk_size)
    torch.testing.assert_close(lp, naive_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, naive_ent, atol=1e-5, rtol=1e-5)
    assert naive_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], naive_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prompts_run_the_decoder_once_per_prompt(tiny_gsm8k):
    """Six rows in two groups: the prompt pass sees 2 rows, the response pass 6."""
    model, tok = tiny_gsm8k
    ids, attn, prompt = batch(tok, len(tok), rows=6, group=3)
    seen = []
    hook = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)),
                                                         with_kwargs=True)
    try:
        response_logprobs(model, ids, attn, prompt)
    finally:
        hook.remove()
    assert seen == [(2, prompt), (6, ids.shape[1] - prompt - 1)]


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


def test_filtered_logprob_entropy_and_gradient_by_hand():
    """p = (0.5, 0.3, 0.15, 0.05), nucleus 0.7 keeps the first two: renormalized (0.625, 0.375)."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().requires_grad_(True)
    lp, ent = token_logprobs(logits, torch.tensor([1]), top_p=0.7)
    assert lp.item() == pytest.approx(math.log(0.375), abs=1e-6)
    assert ent.item() == pytest.approx(-(0.625 * math.log(0.625) + 0.375 * math.log(0.375)), abs=1e-6)
    lp.sum().backward()
    # d log q_1 / d logits = onehot(1) - q on the kept set, 0 outside it (the selection has no gradient)
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.625, 0.625, 0.0, 0.0]]), atol=1e-6, rtol=0)
    # top-k 3 at temperature 0.5: q ~ p**2 over the three largest
    lp, _ = token_logprobs(logits.detach(), torch.tensor([2]), temperature=0.5, top_k=3)
    assert lp.item() == pytest.approx(math.log(0.15**2 / (0.5**2 + 0.3**2 + 0.15**2)), abs=1e-6)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 0.8)])
def test_lean_linear_head_equals_autograd_through_token_logprobs(temperature, top_k, top_p):
    """The in-place head path: same log-probs, entropies and gradients (hidden and weight)."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(6, 8, generator=g)
    targets = torch.randint(0, 11, (6,), generator=g)
    weights = torch.randn(6, generator=g)

    def run(fn):
        h = hidden.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        lp, ent = fn(h)
        (lp * weights).sum().backward()
        return lp.detach(), ent, h.grad, head.weight.grad.clone()

    lean = run(lambda h: head_logprobs(head, h, targets, temperature, top_k, top_p))
    plain = run(lambda h: token_logprobs(head(h), targets, temperature, top_k, top_p))
    for a, b in zip(lean, plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    lp, _ = head_logprobs(head, hidden.clone().requires_grad_(True), targets)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):  # backward consumed the saved log-softmax
        lp.sum().backward()


def test_a_target_outside_the_kept_set_still_counts():
    """Engine and trainer numerics differ slightly: a sampled token at the nucleus boundary
    that the trainer would drop joins the kept set instead of scoring -inf."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    lp, ent = token_logprobs(logits, torch.tensor([2]), top_p=0.7)
    assert lp.item() == pytest.approx(math.log(0.15 / 0.95), abs=1e-6)
    assert math.isfinite(ent.item())


def test_response_logprobs_apply_top_k_by_hand(tiny_echo):
    model, tok = tiny_echo
    ids = torch.tensor([[3, 5, 6, 7, 4]])
    attn = torch.ones_like(ids)
    lp, ent = response_logprobs(model, ids, attn, 2, temperature=0.7, top_k=4, chunk_size=2, max_unchunked_bytes=0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double() / 0.7
    for i, t in enumerate((1, 2, 3)):
        kept = logits[t].topk(4).indices
        target = int(ids[0, t + 1])
        kept = kept if target in kept.tolist() else torch.cat([kept, torch.tensor([target])])
        q = torch.softmax(logits[t][kept], -1)
        assert lp[0, i].item() == pytest.approx(math.log(q[kept.tolist().index(target)]), abs=1e-5)
        assert ent[0, i].item() == pytest.approx(-(q * q.log()).sum().item(), abs=1e-5)


def test_models_with_logit_softcapping_take_the_naive_path(tiny_echo):
    model, _ = tiny_echo
    model.config.final_logit_softcapping = 30.0
    try:
        assert not supports_chunked(model)
    finally:
        model.config.final_logit_softcapping = None


def test_cache_rows_are_chosen_as_transformers_chooses_them_with_a_cheaper_backward(tiny_gsm8k):
    """select_cache_rows: each layer's keys and values are transformers' batch_select_indices' own, and
    gradients flow back to the prompt pass through index_select (not the accumulating index_put)."""
    from gspo_lightning.models.hf_cache import cache_kwargs, output_cache, select_cache_rows

    model, tok = tiny_gsm8k
    ids, attn, prompt = batch(tok, len(tok), rows=2, group=1)
    rows = torch.tensor([1, 0, 1, 1])

    def prompt_cache():
        out = model.get_decoder()(input_ids=ids[:, :prompt], attention_mask=attn[:, :prompt], use_cache=True)
        return output_cache(out)

    ours, theirs = prompt_cache(), prompt_cache()
    select_cache_rows(ours, rows)
    theirs.batch_select_indices(rows)
    assert type(ours.layers[0]).__name__ == "DynamicLayer" and len(ours.layers) == len(theirs.layers)
    for mine, reference in zip(ours.layers, theirs.layers):
        assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)
        assert mine.keys.grad_fn.name() == "IndexSelectBackward0"
    assert cache_kwargs(model.get_decoder(), ours)  # still a cache the decoder takes
