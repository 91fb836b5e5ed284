"""RoutingRecorder: record / replay / measure expert routing, load-balancing loss, and the
MoE path of GSPOModule in a Trainer."""

import warnings

import lightning as L
import pytest
import torch
from torch import nn

from gspo_lightning.data.datamodule import PromptDataModule
from gspo_lightning.training.logprobs import response_logprobs
from gspo_lightning.models.moe import RoutingRecorder
from gspo_lightning.training.module import GSPOModule
from gspo_lightning.rewards import RewardSpec

PROMPT = 4
ECHO_REWARD = [RewardSpec(function="gspo_lightning.data.tasks.echo.echo_reward")]


def tiny_moe(model_type="qwen2_moe", seed=0, **overrides):
    """A 2-layer MoE causal LM of the given architecture (4 of 8 experts would be too many:
    top-2 of 8 is the interesting regime)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2, pad_token_id=0)
    if model_type == "mixtral":
        kwargs.update(num_local_experts=8)
    else:
        kwargs.update(num_experts=8, moe_intermediate_size=16)
    if model_type == "qwen2_moe":
        kwargs.update(shared_expert_intermediate_size=32)
    if model_type == "qwen3_moe":
        kwargs.update(head_dim=8)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **kwargs)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def batch(seed=1, rows=6, width=10, vocab=20):
    """Left-padded prompts (width PROMPT) then responses; row 0 has 2 padding positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = 0
    mask[1, -3:] = 0  # right padding of a short response
    ids[1, -3:] = 0
    return ids, mask


def logprobs(model, ids, mask, rows=None):
    if rows is not None:
        ids, mask = ids[rows], mask[rows]
    return response_logprobs(model, ids, mask, PROMPT)[0]


def perturb_routers(rec, scale=1.0, seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in rec.routers:
            router.module.weight.add_(scale * torch.randn(router.module.weight.shape, generator=g))


class ExpertsSpy:
    """What the experts modules actually received: indices and weights per layer."""

    def __init__(self, model):
        self.calls = []
        blocks = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
        self.handles = [b.experts.register_forward_pre_hook(self._hook) for b in blocks]

    def _hook(self, module, args):
        self.calls.append((args[1].detach().clone(), args[2].detach().clone()))

    def indices(self, shape):
        return [index.reshape(*shape, -1) for index, _ in self.calls]

    def remove(self):
        for h in self.handles:
            h.remove()


def record(rec, model, ids, mask, micro=None):
    micro = micro or ids.shape[0]
    with torch.no_grad(), rec.record():
        return torch.cat([logprobs(model, ids, mask, rows) for rows in torch.arange(ids.shape[0]).split(micro)])


ARCHS = [("qwen2_moe", {}), ("qwen2_moe", {"norm_topk_prob": True}), ("qwen3_moe", {"norm_topk_prob": True}),
         ("qwen3_moe", {"norm_topk_prob": False}), ("mixtral", {})]
ARCH_IDS = ["qwen2_moe", "qwen2_moe-norm", "qwen3_moe-norm", "qwen3_moe", "mixtral"]


@pytest.mark.parametrize("model_type, overrides", ARCHS, ids=ARCH_IDS)
def test_finds_every_moe_layer_and_its_weighting(model_type, overrides):
    model = tiny_moe(model_type, **overrides)
    rec = RoutingRecorder(model)
    assert rec.num_layers == 2 and rec.top_k == 2 and rec.num_experts == 8
    normalized = overrides.get("norm_topk_prob", model_type == "mixtral")
    assert {r.weight_rule for r in rec.routers} == {"renormalized" if normalized else "softmax"}


def test_a_router_that_cannot_be_probed_falls_back_to_its_attributes(monkeypatch):
    import gspo_lightning.models.moe as moe

    def fail(*args):
        raise RuntimeError("sharded weights")

    monkeypatch.setattr(moe, "_probe_weight_rule", fail)
    for norm in (True, False):
        rec = RoutingRecorder(tiny_moe("qwen2_moe", norm_topk_prob=norm))
        assert {r.weight_rule for r in rec.routers} == {"renormalized" if norm else "softmax"}
    assert {r.weight_rule for r in RoutingRecorder(tiny_moe("mixtral")).routers} == {"renormalized"}


def test_dense_model_raises_naming_the_class(tiny_echo):
    model, _ = tiny_echo
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        RoutingRecorder(model)


@pytest.mark.parametrize("model_type, overrides", ARCHS, ids=ARCH_IDS)
def test_replay_forces_the_recorded_experts_after_the_router_changed(model_type, overrides):
    model = tiny_moe(model_type, **overrides)
    rec = RoutingRecorder(model)
    ids, mask = batch()
    record(rec, model, ids, mask, micro=4)  # two forwards, concatenated in call order
    recorded = rec.record_indices
    assert [r.shape for r in recorded] == [(6, 10, 2)] * 2
    perturb_routers(rec)
    rows = torch.tensor([5, 0, 3])

    spy = ExpertsSpy(model)
    with torch.no_grad(), rec.replay(rows):
        logprobs(model, ids, mask, rows)
    replayed = spy.indices((3, 10))
    spy.calls.clear()
    with torch.no_grad():
        logprobs(model, ids, mask, rows)
    free = spy.indices((3, 10))
    spy.remove()

    for layer in range(2):
        assert torch.equal(replayed[layer].long(), recorded[layer][rows])
    assert any(not torch.equal(f.sort(-1).values.long(), r[rows].sort(-1).values) for f, r in zip(free, recorded))


@pytest.mark.parametrize("model_type, overrides", ARCHS, ids=ARCH_IDS)
def test_replayed_weights_are_the_current_routers_weights_of_the_recorded_experts(model_type, overrides):
    model = tiny_moe(model_type, **overrides)
    rec = RoutingRecorder(model)
    ids, mask = batch()
    record(rec, model, ids, mask)
    perturb_routers(rec, scale=0.3)
    rows = torch.tensor([2, 4])
    logits = {}
    handles = [r.module.register_forward_hook(lambda m, a, o, j=j: logits.__setitem__(j, o[0].detach()))
               for j, r in enumerate(rec.routers)]
    spy = ExpertsSpy(model)
    with torch.no_grad(), rec.replay(rows):
        logprobs(model, ids, mask, rows)
    spy.remove()
    for h in handles:
        h.remove()
    normalized = overrides.get("norm_topk_prob", model_type == "mixtral")
    for layer, (index, weights) in enumerate(spy.calls):
        probs = torch.softmax(logits[layer].float(), -1).gather(-1, index)
        expected = probs / probs.sum(-1, keepdim=True) if normalized else probs
        torch.testing.assert_close(weights, expected)
        assert torch.equal(index, rec.record_indices[layer][rows].reshape(-1, 2))


@pytest.mark.parametrize("model_type, overrides", ARCHS[:3], ids=ARCH_IDS[:3])
def test_replay_with_unchanged_weights_gives_the_recorded_logprobs(model_type, overrides):
    model = tiny_moe(model_type, **overrides)
    rec = RoutingRecorder(model)
    ids, mask = batch()
    old = record(rec, model, ids, mask)
    with torch.no_grad(), rec.replay(torch.arange(6)):
        same_rows = logprobs(model, ids, mask)
    assert torch.equal(same_rows, old)  # same rows, same batch: bit for bit
    rows = torch.tensor([4, 1])
    with rec.replay(rows):
        subset = logprobs(model, ids, mask, rows)
    torch.testing.assert_close(subset, old[rows], atol=1e-6, rtol=1e-6)


def test_a_record_made_under_inference_mode_replays_under_autograd():
    model = tiny_moe("qwen2_moe").train()
    rec = RoutingRecorder(model)
    ids, mask = batch()
    with torch.inference_mode(), rec.record():
        logprobs(model, ids, mask)
    rows = torch.tensor([1, 2])
    with rec.replay(rows):
        logprobs(model, ids, mask, rows).sum().backward()
    assert all(r.module.weight.grad.abs().sum() > 0 for r in rec.routers)


def test_gradients_reach_the_router_under_replay():
    model = tiny_moe("qwen2_moe").train()
    rec = RoutingRecorder(model)
    ids, mask = batch()
    record(rec, model, ids, mask)
    rows = torch.tensor([0, 2, 3])
    # unchanged weights: replay is the same function as normal routing, gradients included
    with rec.replay(rows):
        logprobs(model, ids, mask, rows).sum().backward()
    replay_grads = [r.module.weight.grad.clone() for r in rec.routers]
    model.zero_grad()
    logprobs(model, ids, mask, rows).sum().backward()
    for router, grad in zip(rec.routers, replay_grads):
        assert grad.abs().sum() > 0
        torch.testing.assert_close(grad, router.module.weight.grad)
    # changed weights: still a gradient for the router
    model.zero_grad()
    perturb_routers(rec)
    with rec.replay(rows):
        logprobs(model, ids, mask, rows).sum().backward()
    assert all(r.module.weight.grad.abs().sum() > 0 for r in rec.routers)


def test_replay_survives_gradient_checkpointing():
    """A checkpointed layer re-runs its router in backward, after the replay block exited."""
    grads = []
    for checkpointing in (False, True):
        model = tiny_moe("qwen2_moe", norm_topk_prob=True).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        rec = RoutingRecorder(model)
        ids, mask = batch()
        record(rec, model, ids, mask)
        perturb_routers(rec)
        rows = torch.tensor([1, 3, 5])
        with rec.replay(rows):
            lp = logprobs(model, ids, mask, rows)
        lp.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_measure_is_zero_when_unchanged_and_positive_after_the_router_moved():
    model = tiny_moe("qwen2_moe")
    rec = RoutingRecorder(model)
    ids, mask = batch()
    record(rec, model, ids, mask, micro=3)
    rows = torch.tensor([0, 1, 2])
    with torch.no_grad(), rec.measure(rows) as change:
        logprobs(model, ids, mask, rows)
    assert change.value == 0.0
    # only valid (attention mask 1) positions count, every MoE layer
    assert change.total == int(mask[rows].sum()) * 2
    perturb_routers(rec, scale=0.05)
    with torch.no_grad(), rec.measure(rows) as change:
        logprobs(model, ids, mask, rows)
    assert 0.0 < change.value <= 1.0
    # nothing recorded: nothing to compare
    rec.clear()
    assert not rec.has_record
    with torch.no_grad(), rec.measure(rows) as change:
        logprobs(model, ids, mask, rows)
    assert change.value is None


def test_measure_ignores_padding_positions():
    model = tiny_moe("qwen2_moe")
    rec = RoutingRecorder(model)
    ids, mask = batch()
    record(rec, model, ids, mask)
    # fake a record that differs from the real routing only at the padding positions
    for recorded in rec.record_indices:
        recorded[mask == 0] = (recorded[mask == 0] + 1) % 8
    with torch.no_grad(), rec.measure(torch.arange(6)) as change:
        logprobs(model, ids, mask)
    assert change.value == 0.0 and change.total == int(mask.sum()) * 2


def test_replay_without_a_record_or_with_another_layout_fails():
    model = tiny_moe("qwen2_moe")
    rec = RoutingRecorder(model)
    ids, mask = batch()
    with pytest.raises(RuntimeError, match="no routing recorded"):
        with rec.replay(torch.tensor([0])):
            pass
    record(rec, model, ids, mask)
    with pytest.raises(RuntimeError, match="layout"):
        with torch.no_grad(), rec.replay(torch.tensor([0, 1])):
            logprobs(model, ids[:, :8], mask[:, :8], torch.tensor([0, 1]))
    with pytest.raises(IndexError):
        with rec.replay(torch.tensor([6])):
            pass


def naive_load_balancing_loss(layer_logits, mask, num_experts, top_k):
    """Switch / Mixtral: E * sum_e f_e P_e over the valid (token, layer) rows of all layers."""
    counts = [0.0] * num_experts
    prob_sums = [0.0] * num_experts
    rows = 0
    for logits in layer_logits:
        for t in range(logits.shape[0]):
            if not mask[t]:
                continue
            rows += 1
            probs = torch.softmax(logits[t], -1)
            for e in torch.topk(probs, top_k).indices.tolist():
                counts[e] += 1
            for e in range(num_experts):
                prob_sums[e] = prob_sums[e] + probs[e]
    return num_experts * sum(counts[e] / rows * prob_sums[e] / rows for e in range(num_experts))


def test_load_balancing_loss_matches_a_hand_computation():
    model = tiny_moe("qwen2_moe").train()
    rec = RoutingRecorder(model)
    ids, mask = batch(rows=3)
    perturb_routers(rec, scale=0.5)  # make routing uneven
    with rec.capture_router_logits() as cap:
        logprobs(model, ids, mask)
    loss = cap.load_balancing_loss(mask)
    layer_logits = cap.forwards[0][0]
    expected = naive_load_balancing_loss([l.detach() for l in layer_logits], mask.reshape(-1).bool(), 8, 2)
    torch.testing.assert_close(loss.detach(), torch.as_tensor(expected, dtype=loss.dtype))
    assert loss > 0
    # the mask captured from the decoder call gives the same
    torch.testing.assert_close(cap.load_balancing_loss(), loss)
    loss.backward()
    assert all(r.module.weight.grad.abs().sum() > 0 for r in rec.routers)


def test_capture_and_replay_combine():
    model = tiny_moe("qwen2_moe").train()
    rec = RoutingRecorder(model)
    ids, mask = batch()
    record(rec, model, ids, mask)
    rows = torch.tensor([3, 4])
    with rec.replay(rows), rec.capture_router_logits() as cap:
        logprobs(model, ids, mask, rows)
    with rec.capture_router_logits() as free:
        logprobs(model, ids, mask, rows)
    assert len(cap.forwards) == 1 and len(cap.forwards[0][0]) == 2
    # replay forces the experts, not the router: the logits (and so the loss) are those of free routing
    replayed, unforced = cap.load_balancing_loss(mask[rows]), free.load_balancing_loss(mask[rows])
    assert float(replayed) > 0
    torch.testing.assert_close(replayed, unforced)


def test_hooks_do_nothing_outside_the_blocks():
    model = tiny_moe("qwen2_moe")
    ids, mask = batch()
    before = logprobs(model, ids, mask)
    rec = RoutingRecorder(model)
    record(rec, model, ids, mask)
    perturb_routers(rec, scale=0.0)
    with torch.no_grad():
        after = logprobs(model, ids, mask)
        generated = model.generate(ids[2:3], attention_mask=mask[2:3], max_new_tokens=3, do_sample=False)
    assert torch.equal(before, after) and generated.shape == (1, 13)
    assert rec.record_indices[0].shape == (6, 10, 2)  # generation added nothing


# -- transformers 4.x layout: the sparse block computes softmax + top-k from an nn.Linear gate
class LegacyBlock(nn.Module):
    def __init__(self, hidden, num_experts, top_k, norm_topk_prob):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(num_experts)])

    def forward(self, x):
        b, t, h = x.shape
        x = x.reshape(-1, h)
        logits = self.gate(x)
        weights = torch.softmax(logits, dim=1, dtype=torch.float)
        weights, selected = torch.topk(weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for slot in range(self.top_k):
            for e in range(self.num_experts):
                hit = selected[:, slot] == e
                out[hit] += weights[hit, slot, None] * self.experts[e](x[hit])
        return out.reshape(b, t, h)


class LegacyDecoder(nn.Module):
    def __init__(self, norm_topk_prob):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.layers = nn.ModuleList([LegacyBlock(16, 4, 2, norm_topk_prob) for _ in range(2)])

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        return h


class LegacyLM(nn.Module):
    def __init__(self, norm_topk_prob=True):
        super().__init__()
        self.model = LegacyDecoder(norm_topk_prob)
        self.head = nn.Linear(16, 20)

    def get_decoder(self):
        return self.model

    def forward(self, input_ids, attention_mask=None):
        return torch.log_softmax(self.head(self.model(input_ids=input_ids, attention_mask=attention_mask)), -1)


def test_legacy_gate_layout_records_and_replays():
    torch.manual_seed(0)
    model = LegacyLM(norm_topk_prob=True)
    rec = RoutingRecorder(model)
    assert rec.num_layers == 2 and {r.kind for r in rec.routers} == {"linear"}
    ids, mask = batch(rows=4, width=6)
    with torch.no_grad(), rec.record():
        old = model(input_ids=ids, attention_mask=mask)
    with torch.no_grad(), rec.replay(torch.arange(4)):
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask), old)
    perturb_routers(rec, scale=3.0)
    with torch.no_grad(), rec.measure(torch.arange(4)) as change:
        model(input_ids=ids, attention_mask=mask)
    assert change.value > 0
    seen = []
    hooks = [b.register_forward_hook(lambda m, a, o: None) for b in model.model.layers]
    spy = [b.gate.register_forward_hook(lambda m, a, o: seen.append(torch.topk(torch.softmax(o, -1), 2).indices))
           for b in model.model.layers]
    with torch.no_grad(), rec.replay(torch.tensor([1, 2])):
        model(input_ids=ids[1:3], attention_mask=mask[1:3])
    for h in hooks + spy:
        h.remove()
    for layer, index in enumerate(seen):
        recorded = rec.record_indices[layer][1:3].reshape(-1, 2)
        assert torch.equal(index.sort(-1).values, recorded.sort(-1).values)


def test_legacy_gate_without_renormalization_refuses_replay():
    model = LegacyLM(norm_topk_prob=False)
    rec = RoutingRecorder(model)
    ids, mask = batch(rows=2, width=6)
    with torch.no_grad(), rec.record():
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        with rec.replay(torch.arange(2)):
            pass


# -- GSPOModule on the tiny MoE in a Trainer --------------------------------------------
def fit_moe(tmp_path, max_steps=3, **overrides):
    kwargs = dict(model_name_or_path="builtin:tiny-moe-echo", rewards=ECHO_REWARD, num_return_sequences_in_group=4,
                  response_length=5, mini_batch_size=8, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    kwargs.update(overrides)
    L.seed_everything(0, verbose=False)
    module = GSPOModule(**kwargs)
    data = PromptDataModule(path="builtin:echo", tokenizer=kwargs["model_name_or_path"], rollout_batch_size=4,
                            prompt_length=8, val_size=8)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
    )
    from gspo_lightning.run import attach_run_callbacks

    attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    return module, trainer


def test_grpo_with_routing_replay_trains_in_a_trainer(tmp_path):
    module, trainer = fit_moe(tmp_path, max_steps=2, routing_replay=True, importance_sampling="token",
                              router_aux_loss_coef=0.01)
    assert module.routing_recorder is not None and module.routing_recorder.has_record
    assert module.policy_version == 4 and module.rollout_steps == 2  # 16 responses / 8 per mini-batch
    metrics = trainer.callback_metrics
    for key in ("reward/mean", "loss/clip_frac", "grad_norm"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    # measured on the free routing before the replay overrides it: the router did move
    assert float(metrics["moe/routing_change"]) > 0


def test_moe_without_replay_logs_the_routing_change(tmp_path):
    module, trainer = fit_moe(tmp_path, importance_sampling="token", max_steps=2)
    change = float(trainer.callback_metrics["moe/routing_change"])
    assert 0.0 < change <= 1.0  # after an update some tokens pick other experts
