"""GSPOModule inside a real Trainer: on-policy rollouts, skipped passes, config errors."""

import warnings

import lightning as L
import pytest
import torch

from gspo_lightning.data import PromptDataModule
from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.module import GSPOModule, NonFiniteError
from gspo_lightning.rewards import RewardSpec

ECHO_REWARD = [RewardSpec(function="gspo_lightning.tasks.echo.echo_reward")]


def make_module(cls=GSPOModule, **overrides):
    kwargs = dict(
        model_name_or_path="builtin:tiny-echo", rewards=ECHO_REWARD, num_return_sequences_in_group=4,
        response_length=5, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def fit(module, tmp_path, max_steps, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    data = PromptDataModule(path="builtin:echo", rollout_batch_size=4, prompt_length=8, val_size=8)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path, **trainer_kwargs,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    return trainer


class Recording(GSPOModule):
    """Records, before each update, what the rollout was sampled with."""

    def training_step(self, batch, batch_idx):
        rollout = batch["rollout"]
        with torch.no_grad():
            recomputed, _ = response_logprobs(self.policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_width)
        mask = rollout.response_mask
        self.records.append({
            "rollout_version": rollout.policy_version,
            "policy_version": self.policy_version,
            "max_logprob_gap": float((recomputed - rollout.engine_logprobs)[mask].abs().max()),
            "weights": torch.cat([p.detach().flatten() for p in self.policy.parameters()]).clone(),
        })
        return super().training_step(batch, batch_idx)


def test_rollout_at_step_k_comes_from_the_weights_after_update_k_minus_1(tmp_path):
    module = make_module(Recording)
    module.records = []
    fit(module, tmp_path, max_steps=4)
    assert [r["rollout_version"] for r in module.records] == [0, 1, 2, 3]
    assert [r["policy_version"] for r in module.records] == [0, 1, 2, 3]
    # the engine's sampled-token log-probs are those of the weights the update starts from
    assert max(r["max_logprob_gap"] for r in module.records) < 1e-5
    # and those weights did change between steps
    for before, after in zip(module.records, module.records[1:]):
        assert not torch.equal(before["weights"], after["weights"])
    assert module.policy_version == 4 and module.rollout_steps == 4


def test_skipping_the_old_logprob_pass_changes_nothing(tmp_path):
    skipping = make_module()
    fit(skipping, tmp_path, max_steps=3)

    recomputing = make_module()
    recomputing.updates_per_rollout = lambda num: 2  # forces the no-grad old pass; still one update
    fit(recomputing, tmp_path, max_steps=3)
    for a, b in zip(skipping.policy.parameters(), recomputing.policy.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_mini_batches_and_epochs_count_optimizer_steps(tmp_path):
    module = make_module(mini_batch_size=8, micro_batch_size=4, ppo_epochs=2)
    trainer = fit(module, tmp_path, max_steps=8)
    # 16 responses per rollout / 8 per mini-batch x 2 epochs = 4 optimizer steps per rollout
    assert module.policy_version == 8 and module.rollout_steps == 2
    assert trainer.callback_metrics["loss/clip_frac"] >= 0


def test_engine_old_logprobs_and_reference_kl(tmp_path):
    module = make_module(old_logprobs="engine", use_kl_loss=True, kl_loss_coef=0.1, mini_batch_size=8)
    trainer = fit(module, tmp_path, max_steps=4)
    metrics = trainer.callback_metrics
    assert module.reference is not None
    assert float(metrics["kl"]) > 0  # the policy moved away from the frozen reference
    assert float(metrics["engine/logprob_abs_diff"]) < 1e-5
    for key in ("reward/mean", "reward/std", "reward/echo_reward", "reward/zero_std_groups", "response/length_mean",
                "response/truncated_frac", "loss/clip_frac_low", "loss/clip_frac_high", "loss/ratio_min",
                "loss/ratio_max", "entropy", "grad_norm", "lr", "perf/tokens_per_s", "time/generate",
                "time/score", "time/logprobs", "time/train", "time/weight_sync"):
        assert key in metrics, key


class PoisonedLoss(GSPOModule):
    def _logprobs(self, model, rollout, rows):
        lp, ent = super()._logprobs(model, rollout, rows)
        return lp * float("nan"), ent


def test_non_finite_updates_are_skipped_then_stop_the_run(tmp_path):
    module = make_module(PoisonedLoss, max_consecutive_nonfinite=2)
    before = [p.detach().clone() for p in module.parameters()] if module.policy is not None else None
    with pytest.raises(NonFiniteError, match="2 updates in a row"):
        fit(module, tmp_path, max_steps=5)
    assert module.skipped_updates == 2 and module.policy_version == 0
    assert (tmp_path / "checkpoints" / "nonfinite.ckpt").exists()  # kept for inspection
    assert before is None or all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


@pytest.mark.parametrize("overrides, message", [
    (dict(num_return_sequences_in_group=1), "num_return_sequences_in_group >= 2"),
    (dict(clip_low=-0.1), "clip_low must be >= 0"),
    (dict(reward_shift=True), "reward_shift / reward_scale act only with a reward_norm"),
    (dict(mini_batch_size=6, micro_batch_size=4), "not a multiple of micro_batch_size"),
    (dict(add_token_level_kl=True), "needs kl_coef > 0"),
    (dict(dual_clip_loss=True, dual_clip=0.5), "dual_clip must be > 1"),
    (dict(routing_replay=True, old_logprobs="engine"), "set old_logprobs=recompute"),
])
def test_impossible_configs_fail_at_start(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_module(**overrides)


def test_mini_batch_that_does_not_divide_the_rollout_fails_before_generating(tmp_path):
    module = make_module(mini_batch_size=6)  # 4 prompts x 4 responses = 16 per step
    module.engine = "never used"  # generation would fail on this: the check must come first
    with pytest.raises(ValueError, match="do not split into mini-batches of 6"):
        fit(module, tmp_path, max_steps=1)


def test_token_sized_clip_on_sequence_ratios_warns():
    with pytest.warns(UserWarning, match="almost never clips"):
        make_module(clip_high=0.2)


def test_clip_defaults_follow_the_ratio_level():
    assert (make_module().clip_low, make_module().clip_high) == (3e-4, 4e-4)
    token = make_module(importance_sampling="token")
    assert (token.clip_low, token.clip_high) == (0.2, 0.27)
