"""LoRA (``models/lora.py``): adapters on a frozen policy loaded from a saved folder (the hub
path), the base as the reference, merged weights for engines, adapter-only checkpoints with an
exact resume, and both exports loaded the way users load them."""

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

pytest.importorskip("peft")

from gspo_lightning.data.datamodule import PromptDataModule  # noqa: E402
from gspo_lightning.models.loading import load_policy, load_tokenizer  # noqa: E402
from gspo_lightning.models.lora import (  # noqa: E402
    LoRA, MergedLoRAWeight, adapters_disabled, attach_lora, frozen_state_keys, merged_state_dict,
)
from gspo_lightning.rewards import RewardSpec  # noqa: E402
from gspo_lightning.rollout import HFCopyEngine, HFEngine  # noqa: E402
from gspo_lightning.rollout.weight_sync import iter_policy_weights  # noqa: E402
from gspo_lightning.training.logprobs import response_logprobs  # noqa: E402
from gspo_lightning.training.module import GSPOModule  # noqa: E402

ECHO_REWARD = [RewardSpec(function="gspo_lightning.data.tasks.echo.echo_reward")]


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """builtin:tiny-echo saved with save_pretrained: the policy loads with from_pretrained."""
    from gspo_lightning.data.tasks import build_tiny

    torch.manual_seed(3)
    model, tokenizer = build_tiny("builtin:tiny-echo")
    folder = tmp_path_factory.mktemp("base")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def load(folder, lora=None):
    tokenizer = load_tokenizer(folder, False)
    policy = load_policy(folder, tokenizer, "float32")
    return (attach_lora(policy, lora) if lora else policy), tokenizer


def perturb_adapters(policy, seed=5, scale=0.3):
    """Fresh adapters are the identity (B = 0): give every B a value so the adapters matter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[3, 5, 7, 9, 4, 6, 8, 2]])


def test_bad_lora_settings_name_the_fix(base_folder):
    for kwargs, words in [({"rank": 0}, "lora.rank"), ({"alpha": 0.0}, "lora.alpha"), ({"dropout": 1.0}, "lora.dropout"),
                          ({"target_modules": []}, "all-linear")]:
        with pytest.raises(ValueError, match=words):
            LoRA(**kwargs)
    policy, _ = load(base_folder)
    with pytest.raises(ValueError, match=r"matches no layer.*q_proj"):
        attach_lora(policy, LoRA(target_modules=["attention_dense"]))


def test_only_the_adapters_train_and_fresh_adapters_change_nothing(base_folder):
    base, _ = load(base_folder)
    policy, _ = load(base_folder, LoRA(rank=4, alpha=8))
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: the decoder's 7 projections per layer, not the output head
    layers = base.config.num_hidden_layers
    assert len(trainable) == 2 * 7 * layers and not any("lm_head" in n for n in trainable)
    torch.testing.assert_close(logits(policy, IDS), logits(base, IDS), rtol=0, atol=0)
    assert type(policy) is type(base)  # injected in place: the trainer's paths see the same class


def test_merged_weight_is_base_plus_scaled_product_worked_by_hand():
    # W = [[1, 2], [3, 4]], A = [[1, 0]] (r=1, in=2), B = [[2], [-1]] (out=2), scaling = alpha / r = 0.5
    # B @ A = [[2, 0], [-1, 0]]; W + 0.5 * B @ A = [[2, 2], [2.5, 4]]
    merged = MergedLoRAWeight(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 0.0]]),
                              torch.tensor([[2.0], [-1.0]]), 0.5).materialize(lambda t: t)
    assert merged.tolist() == [[2.0, 2.0], [2.5, 4.0]]


def test_merged_weights_give_the_adapted_models_outputs_under_the_base_names(base_folder):
    base, _ = load(base_folder)
    policy, _ = load(base_folder, LoRA(rank=4, alpha=8))
    perturb_adapters(policy)
    sent = dict(iter_policy_weights(policy))
    assert set(sent) == {n for n, _ in base.named_parameters()}  # what any engine loading the base expects
    base.load_state_dict({**base.state_dict(), **sent})
    adapted = logits(policy, IDS)
    torch.testing.assert_close(logits(base, IDS), adapted, rtol=1e-5, atol=1e-5)
    # and the adapters do matter: the unadapted model is far from it
    with adapters_disabled(policy):
        assert (logits(policy, IDS) - adapted).abs().max() > 1e-2
    assert set(merged_state_dict(policy)) >= set(sent)


def make_module(base_folder, **overrides):
    kwargs = dict(model_name_or_path=base_folder, rewards=ECHO_REWARD, num_return_sequences_in_group=4, response_length=5,
                  lora=LoRA(rank=4, alpha=8), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    kwargs.update(overrides)
    return GSPOModule(**kwargs)


def fit(module, folder, max_steps, ckpt_path=None, seed=11, **trainer_kwargs):
    L.seed_everything(seed, verbose=False)
    data = PromptDataModule(path="builtin:echo", tokenizer=module.hparams.model_name_or_path, rollout_batch_size=4,
                            prompt_length=8, val_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=folder, **trainer_kwargs)
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_the_reference_is_the_base_with_no_second_copy(base_folder):
    module = make_module(base_folder, use_kl_loss=True, kl_loss_coef=0.1)
    module.configure_model()
    assert module.reference is None  # no deepcopy of the model
    perturb_adapters(module.policy)
    base, tokenizer = load(base_folder)
    mask = torch.ones_like(IDS)
    rollout = type("R", (), {"input_ids": IDS, "attention_mask": mask, "prompt_width": 3, "num_responses": 1,
                              "images_of": lambda self, rows: None})()
    reference = module._reference_logprobs(rollout)
    expected, _ = response_logprobs(base.eval(), IDS, mask, 3)
    torch.testing.assert_close(reference, expected, rtol=1e-6, atol=1e-6)
    policy_logprobs, _ = response_logprobs(module.policy.eval(), IDS, mask, 3)
    assert (policy_logprobs - expected).abs().max() > 1e-3  # the adapters were on again after the pass


def test_optimizer_holds_only_adapters_and_the_checkpoint_leaves_the_base_out(base_folder, tmp_path):
    module = make_module(base_folder)
    trainer = fit(module, tmp_path, max_steps=2, enable_checkpointing=True)
    optimizer = trainer.optimizers[0]
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in module.policy.parameters() if p.requires_grad}
    ckpt = next(Path(tmp_path).rglob("*.ckpt"))
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    assert not frozen_state_keys(module) & set(saved)


@pytest.mark.parametrize("use_kl_loss", [False, True])
def test_resume_from_an_adapter_checkpoint_is_exact(base_folder, tmp_path, use_kl_loss, monkeypatch):
    # one thread count for all three runs: the thread rule times its choice, and under load (tests side
    # by side) two runs could choose differently, which changes float sums in the last bit
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    straight = make_module(base_folder, use_kl_loss=use_kl_loss, kl_loss_coef=0.05)
    fit(straight, tmp_path / "straight", max_steps=4)
    first = make_module(base_folder, use_kl_loss=use_kl_loss, kl_loss_coef=0.05)
    fit(first, tmp_path / "first", max_steps=2, enable_checkpointing=True)
    ckpt = next((tmp_path / "first").rglob("*.ckpt"))
    resumed = make_module(base_folder, use_kl_loss=use_kl_loss, kl_loss_coef=0.05)
    fit(resumed, tmp_path / "resumed", max_steps=4, ckpt_path=str(ckpt))
    for (name, a), (_, b) in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    moved = [n for n, p in straight.policy.named_parameters() if ".lora_B." in n and p.abs().max() > 0]
    assert moved  # the adapters learned something (B starts at zero)


def test_both_exports_load_the_way_users_load_them(base_folder, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gspo_lightning.run.export import export_checkpoint

    module = make_module(base_folder)
    fit(module, tmp_path, max_steps=2, enable_checkpointing=True)
    module.policy.eval()
    expected = logits(module.policy, IDS)
    hf_model = next(Path(tmp_path).rglob("hf_model"))
    merged = AutoModelForCausalLM.from_pretrained(hf_model)
    assert not any("lora" in n or "base_layer" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, IDS), expected, rtol=1e-5, atol=1e-5)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder), hf_model / "adapter")
    torch.testing.assert_close(logits(adapted, IDS), expected, rtol=1e-5, atol=1e-5)
    # the same two from the checkpoint (gspo export-model --checkpoint)
    out = export_checkpoint(next(Path(tmp_path).rglob("*.ckpt")), tmp_path / "from_ckpt")
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out), IDS), expected, rtol=1e-5, atol=1e-5)
    assert (out / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize("engine", [HFEngine, lambda: HFCopyEngine(dtype="float32")])
def test_engines_sample_from_the_adapted_policy(base_folder, tmp_path, engine):
    """The engine-vs-trainer gap of every step stays at float32 level: a rollout from the base
    model (adapters that never reached the engine) would show as a gap of the adapters' size."""

    class Gaps(L.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.seen.append(float(trainer.callback_metrics["engine/seq_log_ratio_abs_max"]))

    module = make_module(base_folder, engine=engine(), old_logprobs="engine", optimizer=lambda p: torch.optim.AdamW(p, lr=5e-2))
    gaps = Gaps()
    fit(module, tmp_path, max_steps=4, callbacks=[gaps])
    assert len(gaps.seen) == 4 and max(gaps.seen) < 1e-4, gaps.seen
    # the adapters moved the policy far beyond that gap: a base-model rollout would have shown
    base, _ = load(base_folder)
    module.policy.eval()
    mask = torch.ones_like(IDS)
    adapted, _ = response_logprobs(module.policy, IDS, mask, 3)
    unadapted, _ = response_logprobs(base.eval(), IDS, mask, 3)
    assert (adapted - unadapted).abs().mean() > 100 * max(gaps.seen)


def adapter_bytes(policy):
    return sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if ".lora_" in n)


@pytest.mark.parametrize("lora_sync", ["adapter", "merged"])
def test_a_rollout_server_samples_from_the_adapted_policy(base_folder, tmp_path, lora_sync):
    """Pushes to a rollout server (folder transport, HF engine): the adapters alone (the server
    attaches LoRA to its model and loads them) or the merged model under the base names. The
    gap of every step stays at float32 level while the adapters move the policy, and a push
    carries the adapters' bytes (adapter) or the whole model's (merged)."""
    from gspo_lightning.rollout import RemoteEngine
    from tests.helpers import serve_in_thread

    served = LoRA(rank=4, alpha=8).serving_config() if lora_sync == "adapter" else None
    app, httpd, url = serve_in_thread(base_folder, {"class_path": "gspo_lightning.rollout.HFEngine"},
                                      prompt_length=8, response_length=5, lora=served)
    engines = []

    def engine():
        engines.append(RemoteEngine(urls=[url], lora_sync=lora_sync))
        return engines[-1]

    try:
        test_engines_sample_from_the_adapted_policy(base_folder, tmp_path, engine)
    finally:
        httpd.shutdown()
        app.close()
    remote = engines[0]
    assert remote.weights_format == ("adapter" if lora_sync == "adapter" else "full")
    pushed = remote.pushed["manifest"]
    policy, _ = load(base_folder, LoRA(rank=4, alpha=8))
    adapters = adapter_bytes(policy)
    if lora_sync == "adapter":
        assert pushed["bytes"] == adapters
        assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in pushed["names"])
    else:
        base, _ = load(base_folder)
        assert pushed["bytes"] == sum(p.numel() * p.element_size() for p in base.parameters())
        assert pushed["bytes"] > 3 * adapters


def test_a_server_refuses_what_its_adapters_do_not_match(base_folder):
    """A server started without the run's LoRA config (or with another) is named at start,
    not found out by a wrong rollout; a push of other tensor names is refused."""
    from gspo_lightning.errors import RolloutServerError
    from gspo_lightning.rollout import EngineSpec, RemoteEngine
    from tests.helpers import serve_in_thread

    policy, tok = load(base_folder, LoRA(rank=4, alpha=8))
    spec = EngineSpec(model_name_or_path=base_folder, dtype="float32", prompt_length=8, response_length=5, seed=0,
                      eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=policy, tokenizer=tok,
                      lora=LoRA(rank=4, alpha=8))
    app, httpd, url = serve_in_thread(base_folder, {"class_path": "gspo_lightning.rollout.HFEngine"},
                                      prompt_length=8, response_length=5)
    try:
        with pytest.raises(RolloutServerError, match="lora_sync: merged"):
            RemoteEngine(urls=[url]).start(spec)
        merged = RemoteEngine(urls=[url], lora_sync="merged")
        merged.start(spec)  # full weights to a server without adapters: fine
        merged.close()
    finally:
        httpd.shutdown()
        app.close()
    # a server whose own base differs from the policy's (a builtin: model drawn from another random
    # state): adapters alone would apply to other weights
    app, httpd, url = serve_in_thread(base_folder, {"class_path": "gspo_lightning.rollout.HFEngine"},
                                      prompt_length=8, response_length=5, lora=LoRA(rank=4, alpha=8).serving_config())
    try:
        other = load(base_folder, LoRA(rank=4, alpha=8))[0]
        with torch.no_grad():
            next(p for n, p in other.named_parameters() if "base_layer" in n).add_(1e-3)
        with pytest.raises(RolloutServerError, match="another base model"):
            RemoteEngine(urls=[url]).start(EngineSpec(**{**spec.__dict__, "policy": other}))
        RemoteEngine(urls=[url]).start(spec)  # the same base: accepted
    finally:
        httpd.shutdown()
        app.close()
    with pytest.raises(ValueError, match="lora_sync: adapter needs a LoRA policy"):
        base, _ = load(base_folder)
        RemoteEngine(urls=["http://127.0.0.1:1"], lora_sync="adapter").start(
            EngineSpec(**{**spec.__dict__, "policy": base, "lora": None}))


def test_asynchronous_rollouts_come_from_the_adapters_of_their_version(base_folder, tmp_path):
    """max_staleness 1 with a float32 copy engine: the copy the engine samples from holds the
    merged adapters of exactly the version it reports (captured before that step's updates)."""
    from gspo_lightning.objective.offpolicy import OffPolicyCorrection as Correction

    snapshots = {}

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            # the weights this step captures for the engine, under the version they will carry
            snapshots[module.policy_version] = {k: v.clone() for k, v in merged_state_dict(module.policy).items()}

        def on_train_end(self, trainer, module):
            engine = module.worker.engine
            self.version = engine.weights_version
            self.engine_state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}

    watch = Watch()
    module = make_module(base_folder, engine=HFCopyEngine(dtype="float32"), max_staleness=1,
                         off_policy=Correction(mode="decoupled"), optimizer=lambda p: torch.optim.AdamW(p, lr=5e-2))
    fit(module, tmp_path, max_steps=4, callbacks=[watch])
    assert watch.version > 0 and watch.version in snapshots  # a pushed version, not the initial weights
    expected = snapshots[watch.version]
    for name, value in watch.engine_state.items():
        if name in expected:
            torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-6, msg=name)
    moved = max((snapshots[watch.version][k] - snapshots[0][k]).abs().max() for k in expected)
    assert moved > 1e-3  # the adapters had changed the merged weights by then


def test_gspo_serve_reads_the_adapters_a_config_pushes():
    """``gspo serve --config``: a LoRA config's server expects adapter pushes (its engine's
    ``lora_sync`` unset or ``adapter``), a ``lora_sync: merged`` one full weights."""
    from gspo_lightning.run.serve import spec_from_config

    remote = {"class_path": "gspo_lightning.rollout.RemoteEngine", "init_args": {"urls": ["http://h:1"]}}
    config = {"model": {"model_name_or_path": "m", "lora": {"rank": 16, "alpha": 32}, "engine": remote}}
    assert spec_from_config(config).lora == {"rank": 16, "alpha": 32, "target_modules": "all-linear"}
    merged = {**remote, "init_args": {**remote["init_args"], "lora_sync": "merged"}}
    assert spec_from_config({"model": {**config["model"], "engine": merged}}).lora is None
    assert spec_from_config({"model": {"model_name_or_path": "m", "engine": remote}}).lora is None
