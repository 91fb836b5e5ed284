"""Overlong filtering and zero-advantage skipping, through the updater: gradients by hand,
and the skipped run's gradient equal to the full run's."""

import pytest
import torch

from gspo_lightning.training.metrics import StepMetrics
from gspo_lightning.training.row_filters import loss_mask, micro_batches, rows_with_advantage
from gspo_lightning.rollout.worker import Rollout
from gspo_lightning.training.update import PolicyUpdater, UpdateOps
from tests.helpers_update import update_settings_of


def settings(**overrides):
    base = dict(importance_sampling="seq", clip_low=3e-4, clip_high=4e-4, dual_clip=None,
                loss_agg_mode="seq-mean-token-mean", kl_coef=0.0, kl_estimator="k3", horizon=3, ppo_epochs=1,
                mini_batch_size=3, micro_batch_size=3)
    return update_settings_of(**{**base, **overrides})


def rollout_of(response_mask, truncated, group_size=1):
    n, t = response_mask.shape
    return Rollout(
        input_ids=torch.zeros(n, t + 1, dtype=torch.long), attention_mask=torch.ones(n, t + 1, dtype=torch.long),
        prompt_width=1, response_mask=response_mask, engine_logprobs=torch.zeros(n, t), rewards=torch.zeros(n),
        reward_components={}, truncated=truncated, group_size=group_size, policy_version=0, prompts=[""] * n,
        completions=[""] * n,
    )


def run_updater(s, rollout, advantages, theta, ref=None):
    """One update where the policy's log-probs are the parameter ``theta`` itself; returns
    (gradient at the optimizer step, rows forwarded, the step's loss)."""
    seen, grads = [], []

    def policy_logprobs(rows):
        seen.extend(rows.tolist())
        return theta[rows], torch.zeros(len(rows), theta.shape[1])

    class Recording(UpdateOps):  # one process, no optimizer: each step keeps its gradient
        def step(self, counted):
            grads.append(theta.grad.clone() if theta.grad is not None else None)

    ops = Recording([theta])
    metrics = StepMetrics()
    old = theta.detach().clone()
    PolicyUpdater(s, metrics).run(rollout, advantages, old, ref, policy_logprobs, ops)
    return grads[0], seen, metrics.compute()["loss/policy"]


MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)  # lengths 2, 3, 1
TRUNCATED = torch.tensor([False, True, False])  # row 1 ran to the length limit
ADV = torch.tensor([1.0, -2.0, 0.5])


def test_loss_mask_drops_truncated_rows_only_when_asked():
    assert loss_mask(MASK, TRUNCATED, False) is MASK
    assert loss_mask(MASK, TRUNCATED, True).tolist() == [[True, True, False], [False, False, False], [True, False, False]]


@pytest.mark.parametrize("mode, overlong, expected_grad, expected_loss", [
    # at ratio 1 the loss is -sum_i A_i / n over sequences; d/dtheta_it = -A_i / (n L_i) on its tokens
    ("seq-mean-token-mean", False, [[-1 / 6, -1 / 6, 0], [2 / 9, 2 / 9, 2 / 9], [-1 / 6, 0, 0]], -(1 - 2 + 0.5) / 3),
    ("seq-mean-token-mean", True, [[-1 / 4, -1 / 4, 0], [0, 0, 0], [-1 / 4, 0, 0]], -(1 + 0.5) / 2),
    # token-mean: every token carries -A_i r_i / N_tokens; d/dtheta_it = -A_i / N_tokens
    ("token-mean", False, [[-1 / 6, -1 / 6, 0], [1 / 3, 1 / 3, 1 / 3], [-0.5 / 6, 0, 0]], -(2 * 1 - 3 * 2 + 0.5) / 6),
    ("token-mean", True, [[-1 / 3, -1 / 3, 0], [0, 0, 0], [-0.5 / 3, 0, 0]], -(2 * 1 + 0.5) / 3),
    # seq-mean-token-sum: -sum_i L_i A_i / n; d/dtheta_it = -A_i / n
    ("seq-mean-token-sum", True, [[-1 / 2, -1 / 2, 0], [0, 0, 0], [-0.5 / 2, 0, 0]], -(2 * 1 + 0.5) / 2),
])
def test_overlong_filtering_gradients_by_hand(mode, overlong, expected_grad, expected_loss):
    theta = torch.full((3, 3), -1.0, requires_grad=True)
    s = settings(loss_agg_mode=mode, overlong_filtering=overlong, skip_zero_advantage=False)
    grad, _, loss = run_updater(s, rollout_of(MASK, TRUNCATED), ADV, theta)
    torch.testing.assert_close(grad, torch.tensor(expected_grad), rtol=0, atol=1e-6)
    assert loss == pytest.approx(expected_loss, abs=1e-6)


def test_rows_with_advantage_per_response_and_per_token():
    assert rows_with_advantage(torch.tensor([0.0, 1.0, 2.0]), MASK & torch.tensor([[1], [1], [0]]).bool()).tolist() == [False, True, False]
    per_token = torch.tensor([[0.0, 0.0, 5.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # row 0's 5 is outside its mask
    assert rows_with_advantage(per_token, MASK).tolist() == [False, True, False]


def test_micro_batches_pack_on_one_rank_and_keep_their_count_on_several():
    rows = torch.tensor([4, 0, 3, 1, 2, 5])
    teaching = torch.tensor([False, False, True, False, False, True])  # by row index: rows 2 and 5 teach
    assert [r.tolist() for r in micro_batches(rows, 2, None)] == [[4, 0], [3, 1], [2, 5]]
    assert [r.tolist() for r in micro_batches(rows, 2, teaching)] == [[2, 5]]
    teaching[1] = True
    assert [r.tolist() for r in micro_batches(rows, 2, teaching)] == [[1, 2], [5]]
    assert [r.tolist() for r in micro_batches(rows, 2, teaching, same_count=True)] == [[4], [1], [2, 5]]
    nothing = torch.zeros(6, dtype=torch.bool)
    assert [r.tolist() for r in micro_batches(rows, 2, nothing)] == [[4]]
    assert [r.tolist() for r in micro_batches(rows, 2, nothing, same_count=True)] == [[4], [3], [2]]


ADVANTAGES = torch.tensor([0.7, 0.0, 0.0, -1.2, 0.3, 0.0, 0.0, 0.9])  # rows 1, 2, 5, 6 teach nothing


def tiny_policy_update(tiny_echo, skip, kl_coef=0.0, mini=8, micro=3, advantages=ADVANTAGES):
    """The real updater on tiny-echo: 8 responses of up to 4 tokens; returns (gradients at each
    optimizer step, rows forwarded, the logged loss)."""
    model, _ = tiny_echo
    torch.manual_seed(7)
    n, p, r = 8, 3, 4
    ids = torch.randint(3, 14, (n, p + r))  # tiny-echo has 14 tokens
    mask = torch.ones(n, r, dtype=torch.bool)
    mask[0, 3:] = False
    mask[4, 2:] = False
    attention = torch.cat([torch.ones(n, p, dtype=torch.long), mask.long()], 1)
    rollout = Rollout(input_ids=ids, attention_mask=attention, prompt_width=p, response_mask=mask,
                      engine_logprobs=torch.zeros(n, r), rewards=torch.zeros(n), reward_components={},
                      truncated=torch.zeros(n, dtype=torch.bool), group_size=2, policy_version=0, prompts=[""] * n,
                      completions=[""] * n)
    from gspo_lightning.training.logprobs import response_logprobs

    seen, grads = [], []

    def policy_logprobs(rows):
        seen.extend(rows.tolist())
        return response_logprobs(model, ids[rows], attention[rows], p, chunk_size=None)

    params = [q for q in model.parameters() if q.requires_grad]
    class Recording(UpdateOps):  # one process, no optimizer: each step keeps its gradients
        def step(self, counted):
            grads.append([q.grad.clone() for q in params])

    ops = Recording(params)
    with torch.no_grad():
        old = response_logprobs(model, ids, attention, p, chunk_size=None)[0] - 0.01  # ratios away from 1
    ref = old + 0.05 if kl_coef else None
    s = settings(mini_batch_size=mini, micro_batch_size=micro, horizon=r, skip_zero_advantage=skip, kl_coef=kl_coef,
                 clip_low=0.2, clip_high=0.2)
    metrics = StepMetrics()
    PolicyUpdater(s, metrics).run(rollout, advantages, old, ref, policy_logprobs, ops)
    return grads, seen, metrics.compute()["loss/policy"]


def test_skipping_zero_advantage_rows_leaves_loss_and_gradient_unchanged(tiny_echo):
    full_grads, full_rows, full_loss = tiny_policy_update(tiny_echo, skip=False)
    grads, rows, loss = tiny_policy_update(tiny_echo, skip=True)
    assert sorted(full_rows) == list(range(8))
    assert sorted(rows) == [0, 3, 4, 7]  # the rows with an advantage, nothing else forwarded
    assert loss == pytest.approx(full_loss, rel=1e-6)
    assert any(g.abs().sum() > 0 for g in full_grads[0])
    for a, b in zip(full_grads[0], grads[0]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-8)


def test_a_kl_term_keeps_every_row(tiny_echo):
    _, rows, _ = tiny_policy_update(tiny_echo, skip=True, kl_coef=0.1)
    assert sorted(rows) == list(range(8))


def test_a_mini_batch_without_advantage_still_steps_on_one_row(tiny_echo):
    # Adam steps on its momentum even with a zero gradient: each mini-batch keeps one row
    grads, rows, loss = tiny_policy_update(tiny_echo, skip=True, mini=4, micro=4, advantages=torch.zeros(8))
    assert len(rows) == 2 and len(grads) == 2  # one row in each of the two mini-batches
    assert all(float(g.abs().sum()) == 0.0 for step in grads for g in step) and loss == 0.0
