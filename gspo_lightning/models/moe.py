"""Mixture-of-Experts routing: record, replay and measure the experts each token used.

GRPO on MoE models needs *Routing Replay* (GSPO paper, section 5.3): the experts a token was
routed to under ``pi_old`` can change after an update, so a token-level ratio compares two
different sub-networks. Routing Replay records the old policy's top-k expert choices and
forces them when the new policy's log-probs are computed; the router still gets gradients
through the gate weights of those experts.

:class:`RoutingRecorder` does this with forward hooks on the model's router modules and on
its decoder (for the batch layout and the attention mask), so the transformers model code
is untouched::

    rec = RoutingRecorder(model)
    with rec.record():                 # old-policy pass(es), rows 0..N-1 in call order
        old = logprobs(model, batch)
    with rec.replay(rows):             # the same rows, same layout: recorded experts forced
        new = logprobs(model, batch[rows])
    with rec.measure(rows) as change:  # normal routing; change.value = share of changed
        new = logprobs(model, batch[rows])
    with rec.capture_router_logits() as cap:
        ...
    aux = cap.load_balancing_loss(attention_mask)

Supported layouts:

* transformers >= 5 (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, ...): the router is a
  module returning ``(router_logits, routing_weights, expert_indices)``. Replay keeps the
  recorded indices and recomputes their weights from the *current* router logits with the
  router's own rule (found by probing the router once: plain softmax probabilities, the
  probabilities renormalized over the selected experts, i.e. ``norm_topk_prob``, or a softmax
  over the selected logits), so it is exact for ``norm_topk_prob`` true and false alike.
* transformers 4.x sparse blocks whose ``gate`` is an ``nn.Linear`` giving the logits:
  replay sets the logits of non-recorded experts to ``-inf``, which makes the block's
  softmax + top-k pick exactly the recorded experts with the renormalized weights. That is
  only right when the block renormalizes (``norm_topk_prob=True``, Mixtral); otherwise
  :meth:`RoutingRecorder.replay` raises.

Padding: every position is recorded; the routing-change metric counts only positions where
the attention mask of the forward (captured from the decoder call) is 1.

Gradient checkpointing: a checkpointed layer re-runs its router during backward, after the
``replay`` block has exited. The recorder keeps the experts of the last replayed forward
and reuses them when a router runs inside backward, so a replayed forward must be followed
by its backward before the next replayed forward (as ``GSPOModule`` does).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from gspo_lightning.errors import ConfigError

__all__ = ["RoutingRecorder", "RoutingChange", "RouterLogitsCapture", "load_balancing_loss"]


# -- how a router turns logits into the weights of the selected experts --------------------
def _renormalized(logits: Tensor, index: Tensor) -> Tensor:
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, index)
    return probs / probs.sum(dim=-1, keepdim=True)


def _raw_softmax(logits: Tensor, index: Tensor) -> Tensor:
    return torch.softmax(logits.float(), dim=-1).gather(-1, index)


def _softmax_of_selected(logits: Tensor, index: Tensor) -> Tensor:
    return torch.softmax(logits.gather(-1, index), dim=-1, dtype=logits.dtype)


WEIGHT_RULES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "renormalized": _renormalized,  # norm_topk_prob=True, Mixtral
    "softmax": _raw_softmax,  # norm_topk_prob=False (Qwen2-MoE's default)
    "softmax_of_selected": _softmax_of_selected,  # GPT-OSS
}


@dataclass
class _Router:
    module: nn.Module
    kind: str  # "tuple": returns (logits, weights, indices); "linear": returns logits (4.x gate)
    top_k: int
    num_experts: int
    weight_rule: Optional[str]  # a WEIGHT_RULES key; None: unknown (replay unsupported)
    owner: nn.Module  # the sparse block (for error messages)


@dataclass
class RoutingChange:
    """Filled in when a :meth:`RoutingRecorder.measure` block exits."""

    value: Optional[float] = None  # share of (valid token, layer) pairs with a changed expert set
    changed: int = 0
    total: int = 0


@dataclass
class RouterLogitsCapture:
    """Router logits of the forwards run inside :meth:`RoutingRecorder.capture_router_logits`."""

    num_experts: int
    top_k: int
    # one entry per forward: (per-layer logits (B*T, E), attention mask (B, T) or None)
    forwards: list[tuple[list[Tensor], Optional[Tensor]]] = field(default_factory=list)

    def load_balancing_loss(self, attention_mask: Optional[Tensor] = None) -> Tensor:
        """The Switch / Mixtral load-balancing loss over valid tokens, with grad.

        ``E * sum_e f_e * P_e`` with ``f_e`` the share of (token, layer, top-k slot)
        assignments that went to expert ``e`` (times ``top_k``) and ``P_e`` the mean router
        probability of ``e``, both over the valid tokens of every MoE layer together (the
        transformers definition). ``attention_mask``: the mask of the captured forward(s)
        (all of them concatenated along the batch); ``None`` uses the masks captured from the
        decoder calls (all positions when the forward had none).
        """
        if not self.forwards:
            raise RuntimeError("no router logits captured: run the forward inside capture_router_logits()")
        num_layers = len(self.forwards[0][0])
        layers = [torch.cat([logits[j] for logits, _ in self.forwards]) for j in range(num_layers)]
        rows = layers[0].shape[0]
        if attention_mask is None:
            masks = []
            for logits, mask in self.forwards:
                n = logits[0].shape[0]
                masks.append(mask.reshape(-1) if mask is not None else torch.ones(n, device=logits[0].device))
            flat = torch.cat(masks)
        else:
            flat = attention_mask.reshape(-1)
            if flat.numel() != rows:
                raise ConfigError(f"attention_mask has {flat.numel()} positions, the captured forwards {rows}")
        return load_balancing_loss(layers, self.num_experts, self.top_k, flat)


def load_balancing_loss(layer_logits: list[Tensor], num_experts: int, top_k: int, mask: Optional[Tensor] = None) -> Tensor:
    """transformers' ``load_balancing_loss_func`` (qwen2_moe) over per-layer logits ``(rows, E)``."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    device = layer_logits[0].device
    mask = mask.to(device) if mask is not None else None
    loss = load_balancing_loss_func(tuple(layer_logits), num_experts, top_k, mask)
    if not isinstance(loss, Tensor):  # the function returns 0 for no logits
        loss = torch.zeros((), device=device)
    return loss


# -- finding the routers -------------------------------------------------------------------
def _router_classes(model: nn.Module) -> tuple[type, ...]:
    """Router classes a transformers >= 5 model names for its ``router_logits`` output."""
    classes = []
    for module in model.modules():
        spec = getattr(type(module), "_can_record_outputs", None)
        if not isinstance(spec, dict):
            continue
        entries = spec.get("router_logits")
        for entry in entries if isinstance(entries, (list, tuple)) else [entries]:
            cls = getattr(entry, "target_class", None)
            if isinstance(cls, type) and issubclass(cls, nn.Module) and cls not in classes:
                classes.append(cls)
    return tuple(classes)


def _first_param(module: nn.Module) -> Tensor:
    return next(module.parameters())


class _NotATopKRouter(TypeError):
    """The module does not return ``(logits, weights, indices)``."""


def _probe_weight_rule(router: nn.Module, hidden: int, top_k: int) -> Optional[str]:
    """Run the router once on random input and find which rule gives its weights."""
    param = _first_param(router)
    if param.device.type == "meta" or not param.dtype.is_floating_point:
        return None
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(16, hidden, generator=generator).to(device=param.device, dtype=param.dtype)
    with torch.no_grad():
        out = router(x)
    if not isinstance(out, (tuple, list)) or len(out) < 3:
        raise _NotATopKRouter(type(router).__name__)
    logits, weights, index = out[0], out[1], out[2]
    for exact in (True, False):
        for name, rule in WEIGHT_RULES.items():
            guess = rule(logits, index).to(weights.dtype)
            if guess.shape != weights.shape:
                continue
            if torch.equal(guess, weights) if exact else torch.allclose(guess.float(), weights.float(), rtol=1e-2, atol=1e-3):
                return name
    return None


def _weight_rule_from_attributes(router: nn.Module) -> Optional[str]:
    """The weighting when probing is impossible: ``norm_topk_prob`` if the router has it,
    Mixtral's renormalization by name, else unknown (replay will refuse)."""
    norm = getattr(router, "norm_topk_prob", None)
    if norm is None:
        return "renormalized" if "mixtral" in type(router).__name__.lower() else None
    return "renormalized" if norm else "softmax"


def _find_routers(model: nn.Module) -> list[_Router]:
    config = getattr(model, "config", None)
    routers: list[_Router] = []
    classes = _router_classes(model)
    owners = {}
    for parent in model.modules():
        for child in parent.children():
            owners.setdefault(id(child), parent)
    if classes:
        for module in model.modules():
            if not isinstance(module, classes):
                continue
            top_k = getattr(module, "top_k", None) or getattr(config, "num_experts_per_tok", None)
            num_experts = getattr(module, "num_experts", None) or getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
            hidden = getattr(module, "hidden_dim", None) or _first_param(module).shape[-1]
            if not top_k or not num_experts:
                continue
            try:
                rule = _probe_weight_rule(module, hidden, top_k)
            except _NotATopKRouter:
                continue
            except Exception:  # noqa: BLE001 - e.g. sharded (DTensor) weights cannot run alone
                rule = _weight_rule_from_attributes(module)
            routers.append(_Router(module, "tuple", int(top_k), int(num_experts), rule, owners.get(id(module), module)))
        if routers:
            return routers
    # transformers 4.x: the sparse block holds `gate = nn.Linear(hidden, num_experts)`
    for block in model.modules():
        gate = getattr(block, "gate", None)
        top_k = getattr(block, "top_k", None)
        if not isinstance(gate, nn.Linear) or not top_k or not hasattr(block, "experts"):
            continue
        num_experts = gate.out_features
        norm = getattr(block, "norm_topk_prob", None)
        if norm is None:
            norm = "mixtral" in type(block).__name__.lower()  # Mixtral always renormalizes
        routers.append(_Router(gate, "linear", int(top_k), int(num_experts), "renormalized" if norm else "softmax", block))
    return routers


def _decoder_of(model: nn.Module) -> nn.Module:
    getter = getattr(model, "get_decoder", None)
    if callable(getter):
        try:
            decoder = getter()
            if isinstance(decoder, nn.Module):
                return decoder
        except (AttributeError, NotImplementedError, ValueError):
            pass
    return getattr(model, "model", None) or model


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


@dataclass
class _Forward:
    """Layout of the decoder forward in progress."""

    batch: int
    length: int
    mask: Optional[Tensor]  # (B, T) bool, or None: every position valid
    indices: dict[int, Tensor] = field(default_factory=dict)  # layer -> (B, T, k) (record mode)
    logits: dict[int, Tensor] = field(default_factory=dict)  # layer -> (B*T, E) (capture mode)


class RoutingRecorder:
    """Records, replays and measures the top-k experts of every MoE layer of ``model``.

    Raises ``ValueError`` when ``model`` has no Mixture-of-Experts router it recognizes.
    The hooks stay on the model and do nothing outside the context managers.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.routers = _find_routers(model)
        if not self.routers:
            raise ConfigError(f"{type(model).__name__} has no Mixture-of-Experts router that RoutingRecorder "
                             f"recognizes (transformers router modules returning (logits, weights, indices), "
                             f"or sparse blocks with an nn.Linear `gate`)")
        self.top_k = self.routers[0].top_k
        self.num_experts = self.routers[0].num_experts
        self._layer = {id(r.module): j for j, r in enumerate(self.routers)}
        self._chunks: list[list[Tensor]] = []  # per recorded forward: per layer (B, T, k)
        self._record_cache: Optional[list[Tensor]] = None
        self._recording = False
        self._replay_rows: Optional[Tensor] = None
        self._measure: Optional[RoutingChange] = None
        self._measure_rows: Optional[Tensor] = None
        self._measure_counts: list[Tensor] = []
        self._capture: Optional[RouterLogitsCapture] = None
        self._forward: Optional[_Forward] = None
        self._pending: dict[int, Tensor] = {}  # layer -> replayed (B*T, k), for checkpoint recompute
        decoder = _decoder_of(model)
        self._handles = [
            decoder.register_forward_pre_hook(self._decoder_pre_hook, with_kwargs=True),
            decoder.register_forward_hook(self._decoder_post_hook),
            *[r.module.register_forward_hook(self._router_hook) for r in self.routers],
        ]

    # -- public API ------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @property
    def has_record(self) -> bool:
        return bool(self._chunks)

    def clear(self) -> None:
        """Forget the record (and any experts kept for a checkpoint recompute)."""
        self._chunks = []
        self._record_cache = None
        self._pending = {}

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def record_indices(self) -> list[Tensor]:
        """Per MoE layer, the recorded expert indices ``(N, T, top_k)`` (int64)."""
        if not self._chunks:
            raise RuntimeError("no routing recorded: run the old-policy pass inside RoutingRecorder.record()")
        if self._record_cache is None:
            lengths = {chunk[0].shape[1] for chunk in self._chunks}
            if len(lengths) > 1:
                raise RuntimeError(f"recorded forwards have different sequence lengths {sorted(lengths)}: "
                                   f"record forwards of one padded batch only")
            self._record_cache = [torch.cat([chunk[j] for chunk in self._chunks]).long() for j in range(self.num_layers)]
        return self._record_cache

    @contextlib.contextmanager
    def record(self) -> Iterator["RoutingRecorder"]:
        """Record the experts of every forward inside (starting a new record); forwards are
        concatenated along the batch in call order."""
        self.clear()
        self._recording = True
        try:
            yield self
        finally:
            self._recording = False

    @contextlib.contextmanager
    def replay(self, rows) -> Iterator["RoutingRecorder"]:
        """Route every token of the forward(s) inside to its recorded experts. ``rows``: the
        record rows the forward runs on, in order, with the recorded sequence layout."""
        record = self.record_indices  # raises without a record
        for r in self.routers:
            if r.weight_rule is None:
                raise ConfigError(f"routing replay: cannot tell how {type(r.module).__name__} weighs its experts "
                                 f"(not softmax top-k); replay is not supported for it")
            if r.kind == "linear" and r.weight_rule != "renormalized":
                raise ConfigError(f"routing replay of {type(r.owner).__name__} with norm_topk_prob=False needs "
                                 f"transformers >= 5 (a router module); with this version set norm_topk_prob=True "
                                 f"or turn routing_replay off")
        rows = self._rows(rows, record[0])
        self._pending = {}
        self._replay_rows = rows
        try:
            yield self
        finally:
            self._replay_rows = None

    @contextlib.contextmanager
    def measure(self, rows) -> Iterator[RoutingChange]:
        """Run normally; afterwards ``change.value`` is the share of (valid token, MoE layer)
        pairs whose set of selected experts differs from the record (``None``: no record or
        no valid token)."""
        change = RoutingChange()
        if not self._chunks:
            yield change
            return
        self._measure = change
        self._measure_rows = self._rows(rows, self.record_indices[0])
        self._measure_counts = []
        try:
            yield change
        finally:
            counts = self._measure_counts
            self._measure, self._measure_rows, self._measure_counts = None, None, []
            if counts:
                changed, total = torch.stack(counts).sum(0).tolist()
                change.changed, change.total = int(changed), int(total)
                change.value = changed / total if total > 0 else None

    @contextlib.contextmanager
    def capture_router_logits(self) -> Iterator[RouterLogitsCapture]:
        """Keep the router logits (with grad) of the forward(s) inside."""
        capture = RouterLogitsCapture(self.num_experts, self.top_k)
        previous = self._capture
        self._capture = capture
        try:
            yield capture
        finally:
            self._capture = previous

    # -- hooks -----------------------------------------------------------------------------
    @property
    def _active(self) -> bool:
        return self._recording or self._replay_rows is not None or self._measure is not None or self._capture is not None

    def _rows(self, rows, reference: Tensor) -> Tensor:
        rows = torch.as_tensor(rows, dtype=torch.long).to(reference.device).reshape(-1)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= reference.shape[0]):
            raise IndexError(f"rows {rows.tolist()} out of range of the record ({reference.shape[0]} rows)")
        return rows

    def _decoder_pre_hook(self, module, args, kwargs):
        if not self._active:
            self._forward = None  # nothing stale from a forward that raised
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            raise RuntimeError("RoutingRecorder: cannot tell the batch layout of the decoder call (no input_ids / inputs_embeds)")
        batch, length = ids.shape[0], ids.shape[1]
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[0] == batch and mask.shape[1] >= length:
            mask = mask[:, -length:].bool()  # with a KV cache the mask also covers past positions
        else:
            mask = None  # no mask or a prepared 4D mask: every position counts
        self._forward = _Forward(batch, length, mask)
        return None

    def _decoder_post_hook(self, module, args, output):
        forward, self._forward = self._forward, None
        if forward is None:
            return None
        if self._recording:
            missing = [j for j in range(self.num_layers) if j not in forward.indices]
            if missing:
                raise RuntimeError(f"RoutingRecorder: MoE layers {missing} did not run in the recorded forward")
            self._chunks.append([forward.indices[j] for j in range(self.num_layers)])
            self._record_cache = None
        if self._capture is not None and forward.logits:
            self._capture.forwards.append(([forward.logits[j] for j in sorted(forward.logits)], forward.mask))
        return None

    def _router_hook(self, module, args, output):
        layer = self._layer[id(module)]
        router = self.routers[layer]
        forward = self._forward
        if forward is None or not self._active:
            # outside any recorder block, or a checkpointed layer re-running in backward
            if layer in self._pending and torch.is_grad_enabled() and _in_backward():
                return self._replace(router, output, self._pending.pop(layer))
            if self._active and not _in_backward():
                raise RuntimeError("RoutingRecorder: a router ran outside a decoder forward; call the model or its decoder")
            return None
        logits = output[0] if router.kind == "tuple" else output
        if router.kind == "tuple":
            index = output[2]
        else:
            index = torch.topk(torch.softmax(logits.detach().float(), dim=-1), router.top_k, dim=-1).indices
        index = index.detach().reshape(forward.batch, forward.length, -1)

        if self._recording:
            dtype = torch.int16 if router.num_experts < 2**15 else torch.int32
            with torch.inference_mode(False):  # a normal tensor even when recorded under inference_mode
                forward.indices[layer] = index.to(dtype, copy=True)
        if self._measure is not None:
            recorded = self.record_indices[layer][self._measure_rows]
            self._count_change(index, recorded, forward)
        if self._replay_rows is not None:
            recorded = self.record_indices[layer][self._replay_rows]
            if recorded.shape[:2] != (forward.batch, forward.length):
                raise RuntimeError(f"routing replay: the forward has layout {(forward.batch, forward.length)}, the "
                                   f"recorded rows {tuple(recorded.shape[:2])}; run it on the recorded rows, unchanged")
            flat = recorded.reshape(forward.batch * forward.length, -1)
            if torch.is_grad_enabled():
                self._pending[layer] = flat
            output = self._replace(router, output, flat)
            logits = output[0] if router.kind == "tuple" else output
        if self._capture is not None:
            forward.logits[layer] = logits.reshape(forward.batch * forward.length, -1)
        return output if self._replay_rows is not None else None

    def _replace(self, router: _Router, output, index: Tensor):
        """The router output with ``index`` as the selected experts."""
        if router.kind == "tuple":
            logits, weights = output[0], output[1]
            if index.shape[0] != logits.shape[0]:
                raise RuntimeError(f"routing replay: {logits.shape[0]} tokens reached the router, the record has {index.shape[0]}")
            new_weights = WEIGHT_RULES[router.weight_rule](logits, index).to(weights.dtype)
            return (logits, new_weights, index.to(output[2].dtype), *output[3:])
        # 4.x gate logits: -inf off the recorded experts; the block's softmax + top-k +
        # renormalization then gives exactly the recorded experts with their current weights
        keep = torch.zeros_like(output, dtype=torch.bool).scatter_(-1, index.reshape(output.shape[0], -1), True)
        return output.masked_fill(~keep, float("-inf"))

    def _count_change(self, index: Tensor, recorded: Tensor, forward: _Forward) -> None:
        if recorded.shape != index.shape:
            raise RuntimeError(f"routing change: the forward has layout {tuple(index.shape[:2])}, the recorded rows "
                               f"{tuple(recorded.shape[:2])}")
        changed = (index.sort(-1).values != recorded.to(index.dtype).sort(-1).values).any(-1)
        if forward.mask is not None:
            valid = forward.mask.to(changed.device)
            counts = torch.stack([(changed & valid).sum(), valid.sum()])
        else:
            counts = torch.stack([changed.sum(), torch.tensor(changed.numel(), device=changed.device)])
        self._measure_counts.append(counts.float())
