"""GSPOModule inside a real Trainer: on-policy rollouts, the paper's update schedule,
train/eval modes, gradient checkpointing on saved models, config errors."""

import warnings

import lightning as L
import pytest
import torch

from gspo_lightning.data.datamodule import PromptDataModule
from gspo_lightning.training.logprobs import response_logprobs
from gspo_lightning.training.module import GSPOModule, NonFiniteError
from gspo_lightning.rewards import RewardSpec
from gspo_lightning.rollout import HFEngine
from tests.helpers_fit import fit, make_module


class RecordingEngine(HFEngine):
    """Records, at each generation, which weights the engine holds and how its log-probs
    compare with a recomputation by the trainer's code on the same weights."""

    def __init__(self):
        super().__init__()
        self.records = []

    def generate(self, prompt_ids, n, params, seed):
        generation = super().generate(prompt_ids, n, params, seed)
        from gspo_lightning.rollout.worker import build_rollout_tensors

        t = build_rollout_tensors(prompt_ids, generation, n, self.pad_token_id, torch.device("cpu"))
        was_training = self.model.training
        with torch.no_grad():
            recomputed, _ = response_logprobs(self.model.eval(), t["input_ids"], t["attention_mask"], t["prompt_width"])
        self.model.train(was_training)
        self.records.append({
            "version": self.weights_version,
            "gap": float((recomputed - t["engine_logprobs"])[t["response_mask"]].abs().max()),
            "weights": torch.cat([p.detach().flatten() for p in self.model.parameters()]).clone(),
        })
        return generation


def test_rollout_at_step_k_comes_from_the_weights_after_the_updates_of_step_k_minus_1(tmp_path):
    engine = RecordingEngine()
    module = make_module(engine=engine, num_mini_batches=2)
    trainer = fit(module, tmp_path, max_steps=3)
    # two optimizer steps per rollout: the engine holds version 0, 2, 4
    assert [r["version"] for r in engine.records] == [0, 2, 4]
    assert max(r["gap"] for r in engine.records) < 1e-5  # engine log-probs are those weights'
    for before, after in zip(engine.records, engine.records[1:]):
        assert not torch.equal(before["weights"], after["weights"])
    # the trainer's step counts rollouts (max_steps=3), the policy version optimizer steps
    assert trainer.global_step == 3 and module.rollout_steps == 3 and module.policy_version == 6


def test_the_paper_schedule_is_the_default_four_optimizer_steps_per_rollout(tmp_path):
    module = make_module()
    trainer = fit(module, tmp_path, max_steps=2)
    assert module.settings.update.num_mini_batches == 4
    assert module.policy_version == 8 and trainer.global_step == 2
    # sequence ratios move off 1 after the first mini-batch, so the clip can act
    assert float(trainer.callback_metrics["loss/ratio_max"]) > 1.0


def test_one_update_per_rollout_warns_that_the_clip_cannot_act(tmp_path):
    module = make_module(num_mini_batches=1)
    with pytest.warns(UserWarning, match="every importance ratio is exactly 1"):
        module._build_updater(4)
    quiet = make_module(num_mini_batches=1, old_logprobs="engine")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet._build_updater(4)


class CountedOldPass(GSPOModule):
    forced = False

    def _needs_old_pass(self, num_responses):
        return self.forced or super()._needs_old_pass(num_responses)

    def _logprobs_no_grad(self, model, rollout):
        self.old_passes = getattr(self, "old_passes", 0) + 1
        return super()._logprobs_no_grad(model, rollout)


def test_skipping_the_old_logprob_pass_changes_nothing(tmp_path):
    skipping = make_module(CountedOldPass, num_mini_batches=1, old_logprobs="recompute")
    fit(skipping, tmp_path, max_steps=3)
    assert getattr(skipping, "old_passes", 0) == 0
    recomputing = make_module(CountedOldPass, num_mini_batches=1)
    recomputing.forced = True
    fit(recomputing, tmp_path, max_steps=3)
    assert recomputing.old_passes == 3
    for a, b in zip(skipping.policy.parameters(), recomputing.policy.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_mini_batches_and_epochs_count_optimizer_steps(tmp_path):
    module = make_module(num_mini_batches=None, mini_batch_size=8, micro_batch_size=4, ppo_epochs=2)
    trainer = fit(module, tmp_path, max_steps=2)
    # 16 responses per rollout / 8 per mini-batch x 2 epochs = 4 optimizer steps per rollout
    assert module.policy_version == 8 and module.rollout_steps == 2 and trainer.global_step == 2
    # the first mini-batch is on-policy (recomputed old log-probs): nothing clips there
    assert float(trainer.callback_metrics["loss/clip_frac_first_minibatch"]) == 0.0


def test_engine_old_logprobs_and_reference_kl(tmp_path):
    module = make_module(old_logprobs="engine", use_kl_loss=True, kl_loss_coef=0.1, num_mini_batches=2)
    trainer = fit(module, tmp_path, max_steps=2)
    metrics = trainer.callback_metrics
    assert module.reference is not None and not module.reference.training
    assert float(metrics["kl"]) > 0  # the policy moved away from the frozen reference
    assert float(metrics["engine/logprob_abs_diff"]) < 1e-5
    for key in ("reward/mean", "reward/std", "reward/echo_reward", "reward/zero_std_groups", "response/length_mean",
                "response/truncated_frac", "loss/clip_frac_low", "loss/clip_frac_high", "loss/ratio_min",
                "loss/ratio_max", "entropy", "grad_norm", "lr", "perf/tokens_per_s", "time/generate",
                "time/score", "time/logprobs", "time/train", "loss/clip_frac_first_minibatch"):
        assert key in metrics, key


class NoisyEngine(HFEngine):
    """An engine whose log-probs are off by a fixed amount per token (a low-precision engine)."""

    def generate(self, prompt_ids, n, params, seed):
        generation = super().generate(prompt_ids, n, params, seed)
        noise = torch.randn(generation.logprobs.shape, generator=torch.Generator().manual_seed(seed)) * 0.05
        generation.logprobs = torch.where(generation.mask, generation.logprobs + noise, generation.logprobs)
        return generation


def test_engine_mismatch_that_clips_before_any_update_is_logged_and_warned(tmp_path):
    module = make_module(engine=NoisyEngine(), old_logprobs="engine",
                         rewards=[RewardSpec(function="tests.helpers_fit.reward_by_text")])
    L.seed_everything(0, verbose=False)
    data = PromptDataModule(path="builtin:echo", tokenizer="builtin:tiny-echo", rollout_batch_size=4, prompt_length=8, val_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=tmp_path)
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
    with pytest.warns(UserWarning, match="clipped before any update.*engine/trainer mismatch") as record:
        trainer.fit(module, datamodule=data)
    assert sum("clipped before any update" in str(w.message) for w in record) == 1  # once per run
    # a clip counts where it binds (ratio above 1 + eps with A > 0, below 1 - eps with A < 0): about half
    assert float(trainer.callback_metrics["loss/clip_frac_first_minibatch"]) > 0.2
    assert float(trainer.callback_metrics["engine/logprob_abs_diff"]) == pytest.approx(0.04, rel=0.3)


def test_a_model_loaded_from_a_folder_trains_in_train_mode_with_working_checkpointing(tmp_path):
    """from_pretrained returns eval mode: the module must switch the policy to train mode,
    or gradient checkpointing (and dropout) silently does nothing."""
    from gspo_lightning.data.tasks import save_tiny

    folder = save_tiny("builtin:tiny-echo", tmp_path / "saved")

    def run(checkpointing):
        module = make_module(model_name_or_path=str(folder), gradient_checkpointing=checkpointing,
                             use_kl_loss=True, num_mini_batches=1, old_logprobs="engine")
        module.configure_model()
        # a sub-module of a layer: transformers checkpoints the layer's forward, not its hooks
        layer = module.policy.get_decoder().layers[0].mlp
        seen = {"modes": set(), "in_backward": 0}

        def hook(mod, args):
            if torch.is_grad_enabled():  # training forwards and recomputation
                seen["modes"].add(mod.training)
                # a forward while autograd runs a backward is a checkpoint recomputation
                seen["in_backward"] += int(torch._C._current_graph_task_id() != -1)

        layer.register_forward_pre_hook(hook)
        fit(module, tmp_path / str(checkpointing), max_steps=1)
        assert not module.reference.training
        return seen

    plain, checkpointed = run(False), run(True)
    assert plain["modes"] == {True} and checkpointed["modes"] == {True}
    assert plain["in_backward"] == 0
    assert checkpointed["in_backward"] >= 1  # recomputed in backward: checkpointing is active


class PoisonedLoss(GSPOModule):
    def _logprobs(self, model, rollout, rows):
        lp, ent = super()._logprobs(model, rollout, rows)
        return lp * float("nan"), ent


def test_non_finite_updates_are_skipped_then_stop_the_run(tmp_path):
    module = make_module(PoisonedLoss, max_consecutive_nonfinite=2)
    module.configure_model()
    before = [p.detach().clone() for p in module.policy.parameters()]
    with pytest.raises(NonFiniteError, match="2 updates in a row"):
        fit(module, tmp_path, max_steps=5, enable_checkpointing=True)
    assert module.updater.skipped_updates == 2 and module.policy_version == 0
    assert (tmp_path / "checkpoints" / "nonfinite.ckpt").exists()  # kept for inspection
    assert all(torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))


@pytest.mark.parametrize("overrides, message", [
    (dict(num_return_sequences_in_group=1), "num_return_sequences_in_group >= 2"),
    (dict(clip_low=-0.1), "clip_low must be >= 0"),
    (dict(reward_shift=True), "reward_shift / reward_scale act only with a reward_norm"),
    (dict(num_mini_batches=None, mini_batch_size=6, micro_batch_size=4), "not a multiple of micro_batch_size"),
    (dict(add_token_level_kl=True), "needs kl_coef > 0"),
    (dict(dual_clip_loss=True, dual_clip=0.5), "dual_clip must be > 1"),
    (dict(routing_replay=True, old_logprobs="engine"), "set old_logprobs=recompute"),
    (dict(loss_agg_mode="seq-mean"), "loss_agg_mode must be one of"),
    (dict(top_p=0.0), "top_p must be in"),
])
def test_impossible_configs_fail_at_start(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_module(**overrides)


class NeverGenerates(HFEngine):
    def generate(self, *args, **kwargs):
        raise AssertionError("generation must not start before the batch sizes are checked")


@pytest.mark.parametrize("overrides, message", [
    (dict(num_mini_batches=None, mini_batch_size=6), "mini_batch_size=6 must be a multiple"),
    (dict(num_mini_batches=3), "num_mini_batches=3 does not divide the 16 responses"),
])
def test_batch_sizes_that_do_not_divide_fail_before_generating(tmp_path, overrides, message):
    # known when the module is built (the CLI links rollout_batch_size from the data): refused
    # there, before a model loads or anything generates
    with pytest.raises(ValueError, match=message):
        make_module(engine=NeverGenerates(), rollout_batch_size=4, **overrides)  # 4 prompts x 4 = 16


def test_token_sized_clip_on_sequence_ratios_warns():
    with pytest.warns(UserWarning, match="almost never clips"):
        make_module(clip_high=0.2)


def test_clip_defaults_follow_the_ratio_level():
    seq = make_module().settings.objective.resolved
    assert (seq.clip_low, seq.clip_high) == (3e-4, 4e-4)
    token = make_module(importance_sampling="token").settings.objective.resolved
    assert (token.clip_low, token.clip_high) == (0.2, 0.27)


def test_shift_with_group_norm_warns_that_roll_ignores_it():
    with pytest.warns(UserWarning, match="ROLL honours reward_shift only with reward_norm=running"):
        make_module(reward_norm="group", reward_shift=True)


def test_resuming_past_max_steps_says_so_instead_of_only_exporting(tmp_path):
    module = make_module(num_mini_batches=1, export_on_fit_end=True)
    trainer = fit(module, tmp_path, max_steps=2)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    again = make_module(num_mini_batches=1, export_on_fit_end=True)
    with pytest.raises(ValueError, match="already at step 2 and trainer.max_steps=2.*above 2"):
        fit(again, tmp_path / "again", max_steps=2, ckpt_path=str(tmp_path / "last.ckpt"))
    assert not (tmp_path / "again" / "hf_model").exists()


def reward_failing_on_long_completions(prompts, completions, **columns):
    if any(len(c) > 3 for c in completions):
        raise ValueError("cannot grade long answers")
    return [1.0] * len(completions)


def test_zeroed_reward_errors_are_counted_and_shown_on_the_console(tmp_path):
    reward = [RewardSpec(function="tests.test_module.reward_failing_on_long_completions")]
    module = make_module(rewards=reward, on_reward_error="zero", num_mini_batches=1, old_logprobs="engine")
    L.seed_everything(0, verbose=False)
    data = PromptDataModule(path="builtin:echo", tokenizer="builtin:tiny-echo", rollout_batch_size=4, prompt_length=8, val_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
    with pytest.warns(UserWarning, match=r"step 1: 16 response\(s\) scored 0 because a reward function failed"):
        trainer.fit(module, datamodule=data)
    assert float(trainer.callback_metrics["reward/errors"]) == 16


def test_with_checkpointing_off_a_failed_run_writes_no_checkpoint(tmp_path):
    module = make_module(PoisonedLoss, max_consecutive_nonfinite=1)
    with pytest.raises(NonFiniteError):
        fit(module, tmp_path, max_steps=2, enable_checkpointing=False)
    assert not list(tmp_path.rglob("*.ckpt"))


def test_with_top_k_and_top_p_the_trainer_scores_the_distribution_the_engine_sampled(tmp_path):
    module = make_module(top_k=3, top_p=0.9, temperature=0.7, num_mini_batches=2)
    trainer = fit(module, tmp_path, max_steps=1)
    # measured on the first mini-batch, before any update: same weights, same filtered distribution
    assert float(trainer.callback_metrics["engine/logprob_abs_diff"]) < 1e-5
    assert float(trainer.callback_metrics["loss/clip_frac_first_minibatch"]) == 0.0
