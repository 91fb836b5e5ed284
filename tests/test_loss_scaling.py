"""fp16 mixed precision with a loss scaler: the update clips and logs unscaled gradients,
and an overflowing step is the scaler's to skip, lowering its scale.

On CPU Lightning brings no GradScaler, so the tests pass one explicitly, as a GPU run
with ``trainer.precision: 16-mixed`` gets one."""

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from gspo_lightning.rewards import RewardSpec
from gspo_lightning.rollout import HFEngine
from tests.helpers_fit import fit, make_module

INITIAL_SCALE = 2.0**16  # GradScaler's default


def scaled_fp16():
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE))


class FullPrecisionEngine(HFEngine):
    """Samples in fp32 under the trainer's autocast, so both runs train on the same responses."""

    def generate(self, prompt_ids, n, params, seed):
        with torch.autocast("cpu", enabled=False):
            return super().generate(prompt_ids, n, params, seed)


def one_step(tmp_path, plugins, **overrides):
    torch.manual_seed(0)  # the tiny model's initial weights
    module = make_module(engine=FullPrecisionEngine(), rewards=[RewardSpec(function="tests.helpers_fit.reward_by_text")],
                         num_mini_batches=1, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), **overrides)
    module.configure_model()
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer = fit(module, tmp_path, max_steps=1, plugins=plugins)
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(module.policy.parameters(), before)])
    return module, trainer, delta


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])  # off, and a clip that binds (the norm is ~1.2)
def test_a_scaled_fp16_step_equals_the_fp32_step(tmp_path, max_grad_norm):
    _, fp32, delta32 = one_step(tmp_path / "fp32", None, max_grad_norm=max_grad_norm)
    _, fp16, delta16 = one_step(tmp_path / "fp16", [scaled_fp16()], max_grad_norm=max_grad_norm)
    norm32, norm16 = float(fp32.callback_metrics["grad_norm"]), float(fp16.callback_metrics["grad_norm"])
    assert 0.2 < norm32 < 2  # the unscaled norm of this step; the scaled one is 2**16 times larger
    assert norm16 == pytest.approx(norm32, rel=0.02)
    # SGD: the update is lr x the (clipped) gradient, so a scale left in it shows at once
    expected_size = 0.5 * min(norm32, max_grad_norm or float("inf"))
    assert float(delta32.norm()) == pytest.approx(expected_size, rel=1e-3)
    assert float((delta16 - delta32).norm()) < 0.02 * float(delta32.norm())
    assert fp16.precision_plugin.scaler.get_scale() == INITIAL_SCALE  # a finite step keeps the scale


def overflow_once(module_cls):
    """The first backward of the run yields an inf gradient; the loss itself stays finite."""

    class Overflowing(module_cls):
        overflows_left = 1

        def _logprobs(self, model, rollout, rows):
            logprobs, entropy = super()._logprobs(model, rollout, rows)
            if torch.is_grad_enabled() and type(self).overflows_left > 0:
                type(self).overflows_left -= 1
                logprobs.register_hook(lambda grad: grad * float("inf"))
            return logprobs, entropy

    return Overflowing


def test_an_overflowing_step_is_skipped_and_lowers_the_scale(tmp_path):
    from gspo_lightning.training.module import GSPOModule

    module = make_module(overflow_once(GSPOModule), engine=FullPrecisionEngine(), num_mini_batches=2,
                         max_consecutive_nonfinite=1,  # an overflow the scaler handles is not a failure
                         rewards=[RewardSpec(function="tests.helpers_fit.reward_by_text")],
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    trainer = fit(module, tmp_path, max_steps=1, plugins=[scaled_fp16()])
    assert trainer.precision_plugin.scaler.get_scale() == INITIAL_SCALE / 2
    assert module.updater.skipped_updates == 1 and module.updater.consecutive_nonfinite == 0
    assert module.policy_version == 1 and trainer.global_step == 1  # the second mini-batch stepped


def test_overflows_below_a_scale_of_one_are_failures(tmp_path):
    """Below scale 1 the gradients overflow unscaled: the non-finite limit applies again."""
    from gspo_lightning.training.module import GSPOModule, NonFiniteError

    class AlwaysOverflowing(overflow_once(GSPOModule)):
        def _logprobs(self, model, rollout, rows):
            type(self).overflows_left = 1
            return super()._logprobs(model, rollout, rows)

    module = make_module(AlwaysOverflowing, engine=FullPrecisionEngine(), num_mini_batches=2, max_consecutive_nonfinite=2,
                         rewards=[RewardSpec(function="tests.helpers_fit.reward_by_text")])
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=4.0))
    with pytest.raises(NonFiniteError, match="2 updates in a row"):
        fit(module, tmp_path, max_steps=5, plugins=[plugin])
    # 4 -> 2 -> 1: handled by the scaler; 0.5, 0.25: failures, the second stops the run
    assert plugin.scaler.get_scale() == 0.25 and module.updater.skipped_updates == 4
    assert module.policy_version == 0
