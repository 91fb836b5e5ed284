"""Host syncs and collectives of the update loop: one finite check per optimizer step (not
per micro-batch), every rank runs every backward even when a loss is not finite (a sharded
backward is collective), and a strategy that measures the gradient norm in its step
(DeepSpeed) is what gets logged."""

import pytest
import torch

from gspo_lightning.training.distributed import deepspeed_grad_norm
from gspo_lightning.training.metrics import StepMetrics
from gspo_lightning.rollout.worker import Rollout
from gspo_lightning.training.update import PolicyUpdater, UpdateOps
from tests.helpers_update import update_settings_of

N, T = 8, 3


def rollout() -> Rollout:
    mask = torch.ones(N, T, dtype=torch.bool)
    mask[1, 2:] = False
    ids = torch.zeros(N, 2 + T, dtype=torch.long)
    return Rollout(ids, torch.ones_like(ids), 2, mask, torch.zeros(N, T), torch.zeros(N), {}, torch.zeros(N, dtype=torch.bool),
                   group_size=4, policy_version=0, prompts=[], completions=[])


def run(micro_batch_size: int, advantages: torch.Tensor, measured=None):
    theta = torch.nn.Parameter(torch.linspace(-1.0, -0.5, N * T).view(N, T))
    calls = {"all_reduce": 0, "backward": 0, "step": 0, "last": []}

    class Recording(UpdateOps):
        def all_reduce_sum(self, t):
            calls["all_reduce"] += 1
            return t.clone()

        def accumulate(self, last):
            calls["last"].append(last)
            return super().accumulate(last)

        def backward(self, loss):
            calls["backward"] += 1
            loss.backward()

        def clip_gradients(self):
            return theta.grad.norm() if theta.grad is not None else torch.tensor(0.0)

        def step(self, counted):
            calls["step"] += 1
            with torch.no_grad():
                theta.sub_(0.1 * theta.grad)
            return measured

    ops = Recording([theta])
    settings = update_settings_of(importance_sampling="seq", clip_low=0.2, clip_high=0.2, dual_clip=None,
                              loss_agg_mode="seq-mean-token-mean", kl_coef=0.0, kl_estimator="k3", horizon=T,
                              ppo_epochs=1, mini_batch_size=4, micro_batch_size=micro_batch_size,
                              max_consecutive_nonfinite=10)
    metrics = StepMetrics()
    updater = PolicyUpdater(settings, metrics)
    old = theta.detach().clone() - 0.01
    updater.run(rollout(), advantages, old, None, lambda rows: (theta[rows], torch.zeros(len(rows), T)), ops,
                generator=torch.Generator().manual_seed(7))
    return calls, updater, metrics.compute(), theta.detach()


def test_one_finite_check_per_optimizer_step_whatever_the_micro_batches():
    """2 optimizer steps: per step the loss counts, the finite flag and the logged loss are
    all-reduced, 3 collectives, with 1 micro-batch per step or 4. The weights are the same."""
    advantages = torch.linspace(-1, 1, N)
    whole, _, metrics_whole, theta_whole = run(4, advantages)
    split, _, metrics_split, theta_split = run(1, advantages)
    assert whole["all_reduce"] == split["all_reduce"] == 2 * 3
    assert split["backward"] == 8 and whole["backward"] == 2
    # DDP syncs in the backward of each optimizer step's last micro-batch only
    assert split["last"] == [False, False, False, True] * 2 and whole["last"] == [True, True]
    torch.testing.assert_close(theta_split, theta_whole)
    assert metrics_split["loss/policy"] == pytest.approx(metrics_whole["loss/policy"], rel=1e-6)


def test_a_nonfinite_loss_still_runs_every_backward_and_skips_the_step():
    """Row 1's advantage is NaN: its mini-batch still runs all 4 backwards (another rank's
    sharded backward waits for this one's), then the step is skipped; the other step runs."""
    advantages = torch.linspace(-1, 1, N)
    advantages[1] = float("nan")
    calls, updater, metrics, _ = run(1, advantages)
    assert calls["backward"] == 8
    assert calls["step"] == 1 and updater.skipped_updates == 1
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if k.startswith("loss/"))


def test_a_norm_measured_by_the_strategy_step_is_logged():
    _, _, metrics, _ = run(4, torch.linspace(-1, 1, N), measured=torch.tensor(2.5))
    assert metrics["grad_norm"] == pytest.approx(2.5)


def test_deepspeed_grad_norm_is_the_engines():
    class Engine:
        def __init__(self, norm):
            self.norm = norm

        def get_global_grad_norm(self):
            return self.norm

    assert deepspeed_grad_norm(Engine(None)) is None
    assert float(deepspeed_grad_norm(Engine(0.75))) == pytest.approx(0.75)
