"""Decode steps of Llama-family models (Llama, Qwen2, Qwen3, Mistral) over a preallocated
KV cache, for the Hugging Face engine.

A decode step of a small model is mostly Python: the Hugging Face forward builds a 4D
mask, grows its cache by concatenation and dispatches through several wrappers for every
token. Here the prompt is prefilled by the model's own forward, its keys and values are
copied once into buffers sized for the whole response, and each step writes one column
and attends over the filled prefix, calling the model's own submodules (norms, linear
layers, MLP, rotary embedding) so that numerics and weights are the model's.
Unsupported models (other attention variants, sliding windows, dynamic RoPE) keep the
Hugging Face forward: :func:`supports` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}
_STATIC_ROPE = {None, "default", "linear", "llama3"}  # cos/sin depend on the position only


def supports(model: nn.Module) -> bool:
    """Whether :class:`KVDecoder` reproduces this model's forward."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in _MODEL_TYPES:
        return False
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) not in _STATIC_ROPE:
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return False
    if _sharded(model):
        return False
    decoder = model.get_decoder()
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(hasattr(decoder, name) for name in needed):
        return False
    for layer in decoder.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or getattr(attn, "sliding_window", None) is not None:
            return False
        if not all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")):
            return False
    return True


def kv_cache_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token holds over all layers (0 when the config does not say)."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not (layers and heads and hidden):
        return 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _sharded(model: nn.Module) -> bool:
    """FSDP gathers a layer's weights in that layer's forward; calling its submodules
    directly would see shards. FSDP2 units gathered for a whole generation
    (``rollout/hf.py``'s ``gathered``) hold plain tensors and decode here."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return True
    return any(type(m).__name__.startswith("FullyShardedDataParallel") for m in model.modules())


class KVDecoder:
    """Decode state of ``rows`` sequences: per-layer key/value buffers ``(rows, kv_heads,
    prompt + new_tokens, head_dim)``, the additive attention mask and the next position.

    Args:
        model: the causal LM (eval mode, no grad).
        prefill: the ``DynamicCache`` of the prompts' forward, ``prompts`` rows.
        prompt_mask: ``(prompts, P)`` attention mask of the left-padded prompts.
        repeat: samples per prompt: prompt ``i``'s cache fills rows ``i*repeat .. i*repeat+repeat-1``.
        new_tokens: most tokens that will be fed back (``max_new_tokens - 1``).
    """

    def __init__(self, model: nn.Module, prefill, prompt_mask: Tensor, repeat: int, new_tokens: int):
        self.model = model
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        width = prompt_mask.shape[1]
        self.length = width  # columns filled
        rows = prompt_mask.shape[0] * repeat
        self.keys, self.values = [], []
        for layer in prefill.layers:
            k, v = layer.keys, layer.values  # (prompts, kv_heads, P, head_dim), rotary applied
            shape = (rows, k.shape[1], width + new_tokens, k.shape[3])
            keys = k.new_empty(shape)
            values = v.new_empty(shape)
            keys[:, :, :width] = k.repeat_interleave(repeat, dim=0)
            values[:, :, :width] = v.repeat_interleave(repeat, dim=0)
            self.keys.append(keys)
            self.values.append(values)
        mask = prompt_mask.repeat_interleave(repeat, dim=0)
        dtype = self.keys[0].dtype if self.keys else torch.float32
        kv_heads = self.keys[0].shape[1] if self.keys else 1
        # the additive mask of every (row, kv head) pair, the batch of the attention matmuls
        bias = torch.zeros((rows, kv_heads, 1, width + new_tokens), dtype=dtype, device=mask.device)
        bias[:, :, 0, :width].masked_fill_((mask == 0)[:, None], torch.finfo(dtype).min)  # left padding
        self.bias = bias.view(rows * kv_heads, 1, width + new_tokens)
        self.position = mask.sum(-1) - 1  # (rows,) position of the last prompt token
        # cos/sin of every position the response will use, computed once, shaped to broadcast
        # over (rows, heads, head_dim); rotate_half(x) * sin == roll(x, half) * signed_sin
        positions = torch.arange(int(self.position.max()) + new_tokens + 2, device=mask.device)[None]
        cos, sin = self.decoder.rotary_emb(self.keys[0] if self.keys else mask.float(), positions)
        half = cos.shape[-1] // 2
        sign = torch.ones(cos.shape[-1], dtype=sin.dtype, device=sin.device)
        sign[:half] = -1
        self.cos = cos[0][:, None, :]
        self.signed_sin = (sin[0] * sign)[:, None, :]
        self.half = half
        self.fused = [_FusedLayer.build(layer) for layer in self.decoder.layers] if _fusion_pays(self.decoder) else None

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """Feed one token per row; returns the next-token logits ``(rows, vocab)`` in float32.

        Written for few tensor operations per layer: at small sizes each costs more in
        dispatch than in arithmetic."""
        if self.length >= self.bias.shape[-1]:
            raise RuntimeError("KVDecoder: more tokens fed than new_tokens")
        self.position = self.position + 1
        column = self.length
        self.length += 1
        cos = self.cos[self.position]  # (rows, 1, head_dim)
        signed_sin = self.signed_sin[self.position]
        hidden = self.decoder.embed_tokens(tokens)  # (rows, hidden)
        for index, layer in enumerate(self.decoder.layers):
            fused = self.fused[index] if self.fused is not None else None
            if fused is not None:
                hidden = self._fused_layer(fused, layer.self_attn, index, hidden, column, cos, signed_sin)
            else:
                hidden = self._module_layer(layer, index, hidden, column, cos, signed_sin)
        return self.head(_norm(self.decoder.norm, hidden)).float()

    def _fused_layer(self, fused: "_FusedLayer", attn: nn.Module, index: int, hidden: Tensor, column: int,
                     cos: Tensor, signed_sin: Tensor) -> Tensor:
        """One layer from the fused weights: norms folded in, residual adds inside ``addmm``."""
        x = fused.input_norm(hidden)
        qkv = F.linear(x, fused.qkv, fused.qkv_bias)
        q_width, k_width = fused.qkv_sizes[0], fused.qkv_sizes[1]
        if fused.qk_norms is None:  # q and k are adjacent columns: one rotary embedding for both
            qk = qkv[:, :q_width + k_width].view(qkv.shape[0], -1, attn.head_dim)
        else:  # Qwen3: per-head norms before the rotary embedding
            q_norm, k_norm = fused.qk_norms
            qk = torch.cat((q_norm(qkv[:, :q_width].view(qkv.shape[0], -1, attn.head_dim)),
                            k_norm(qkv[:, q_width:q_width + k_width].view(qkv.shape[0], -1, attn.head_dim))), dim=1)
        out = self._attend(qk, qkv[:, q_width + k_width:], index, column, cos, signed_sin, attn.scaling)
        hidden = torch.addmm(hidden, out, fused.o)
        if fused.o_bias is not None:
            hidden = hidden + fused.o_bias
        gate, up = F.linear(fused.post_norm(hidden), fused.gate_up).chunk(2, dim=-1)
        return torch.addmm(hidden, fused.act(gate) * up, fused.down)

    def _module_layer(self, layer: nn.Module, index: int, hidden: Tensor, column: int, cos: Tensor,
                      signed_sin: Tensor) -> Tensor:
        """One layer through the model's own modules (large models, adapters, hooks)."""
        attn = layer.self_attn
        x = _norm(layer.input_layernorm, hidden)
        q, k = attn.q_proj(x).view(x.shape[0], -1, attn.head_dim), attn.k_proj(x).view(x.shape[0], -1, attn.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotary embedding
            q, k = attn.q_norm(q), attn.k_norm(k)
        out = self._attend(torch.cat((q, k), dim=1), attn.v_proj(x), index, column, cos, signed_sin, attn.scaling)
        hidden = hidden + attn.o_proj(out)
        return hidden + layer.mlp(_norm(layer.post_attention_layernorm, hidden))

    def _attend(self, qk: Tensor, v: Tensor, index: int, column: int, cos: Tensor, signed_sin: Tensor,
                scaling: float) -> Tensor:
        """Attention of one new token per row. ``qk``: ``(rows, heads + kv_heads, head_dim)``
        before the rotary embedding (query heads, then key heads); ``v``: ``(rows, kv_heads *
        head_dim)``. Writes the new key and value into column ``column``; returns ``(rows, heads * head_dim)``."""
        keys, values = self.keys[index], self.values[index]
        rows, kv_heads, _, head_dim = keys.shape
        qk = torch.addcmul(qk * cos, qk.roll(self.half, dims=-1), signed_sin)
        heads = qk.shape[1] - kv_heads
        keys[:, :, column] = qk[:, heads:]
        values[:, :, column] = v.view(rows, kv_heads, head_dim)
        # batch (row, kv head): its query heads against the filled columns, mask added in the same op
        q = qk[:, :heads].reshape(rows * kv_heads, heads // kv_heads, head_dim)
        filled = keys[:, :, :self.length].reshape(rows * kv_heads, self.length, head_dim)
        scores = torch.baddbmm(self.bias[..., :self.length], q, filled.transpose(1, 2), alpha=scaling)
        probs = torch.softmax(scores, dim=-1) if scores.dtype == torch.float32 else \
            torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        out = torch.bmm(probs, values[:, :, :self.length].reshape(rows * kv_heads, self.length, head_dim))
        return out.view(rows, heads * head_dim)


# Fused copies of a layer's weights (rebuilt for every generation: the weights change
# between rollouts) save matmul calls and elementwise passes per layer and step, which pays
# where a call costs more than its arithmetic: models up to this many bytes of projection
# weights. Above it matmuls dominate and the copies cost more than they save (a 25M model,
# 100 MB: 31 decode steps of 64 rows 1.41 s fused vs 1.35 s unfused).
_FUSE_MAX_BYTES = 64 * 2**20


def _fusion_pays(decoder: nn.Module) -> bool:
    size = 0
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, getattr(mlp, "gate_proj", None),
                     getattr(mlp, "up_proj", None), getattr(mlp, "down_proj", None)):
            if type(proj) is nn.Linear:
                size += proj.weight.numel() * proj.weight.element_size()
    return size <= _FUSE_MAX_BYTES


@dataclass
class _FusedLayer:
    """A layer's weights rearranged for :meth:`KVDecoder._fused_layer`: q|k|v and gate|up
    concatenated, float32 RMSNorm weights multiplied into the projection that follows them
    (``W (w * x) == (W diag(w)) x``), o and down transposed for ``addmm``."""

    input_norm: Callable[[Tensor], Tensor]
    qkv: Tensor
    qkv_bias: Optional[Tensor]
    qkv_sizes: tuple[int, int, int]
    qk_norms: Optional[tuple[nn.Module, nn.Module]]
    o: Tensor  # (in, out)
    o_bias: Optional[Tensor]
    post_norm: Callable[[Tensor], Tensor]
    gate_up: Tensor
    act: Callable[[Tensor], Tensor]
    down: Tensor  # (in, out)

    @staticmethod
    def build(layer: nn.Module) -> Optional["_FusedLayer"]:
        """``None`` when some piece is not a plain module (adapters, hooks, MLP variants)."""
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        gate, up, down = (getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
        plain = all(_plain_linear(p) for p in (*projections, attn.o_proj, gate, up, down))
        if not plain or any(p.bias is not None for p in (gate, up, down)) or not hasattr(mlp, "act_fn") or has_forward_hooks(mlp):
            return None
        qk_norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else ()
        if any(has_forward_hooks(m) for m in (attn, layer, *qk_norms)):
            return None
        qkv = torch.cat([p.weight for p in projections]).detach()
        gate_up = torch.cat([gate.weight, up.weight]).detach()
        input_norm, qkv = _fold_norm(layer.input_layernorm, qkv)
        post_norm, gate_up = _fold_norm(layer.post_attention_layernorm, gate_up)
        bias = None
        if any(p.bias is not None for p in projections):
            bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                              for p in projections]).detach()
        qk_norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
        o_bias = attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None
        return _FusedLayer(input_norm, qkv, bias, tuple(p.out_features for p in projections), qk_norms,
                           attn.o_proj.weight.detach().t(), o_bias, post_norm, gate_up, mlp.act_fn,
                           down.weight.detach().t())


def _fold_norm(norm: nn.Module, weight: Tensor) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """``(normalize, weight')`` with ``F.linear(normalize(x), weight') == F.linear(norm(x), weight)``."""
    if _plain_rms_norm(norm) and weight.dtype == torch.float32:
        eps = norm.variance_epsilon
        return (lambda x: _unit_rms(x, eps)), weight * norm.weight.detach()[None, :]
    return (lambda x: _norm(norm, x)), weight


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether hooks run around ``module``'s forward (ZeRO-3 gathering, MoE routing records):
    then its weights or outputs are not what a fused copy would compute."""
    return bool(module._forward_hooks or module._forward_pre_hooks)  # torch has no public accessor for them


def _plain_linear(module) -> bool:
    return type(module) is nn.Linear and not has_forward_hooks(module)


def _plain_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__ in _RMS_NORMS and getattr(module, "variance_epsilon", None) is not None and not has_forward_hooks(module)


def _unit_rms(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)`` in four operations (``vector_norm`` is a faster
    reduction than ``mean`` at decode sizes)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * torch.rsqrt(torch.addcmul(_scalar(eps, x), norm, norm, value=1.0 / x.shape[-1]))


_SCALARS: dict = {}


def _scalar(value: float, like: Tensor) -> Tensor:
    """A cached 0-d tensor (``addcmul`` takes tensors)."""
    key = (value, like.dtype, like.device)
    if key not in _SCALARS:
        _SCALARS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return _SCALARS[key]


def _norm(module: nn.Module, x: Tensor) -> Tensor:
    """A Llama-style RMSNorm in float32 through :func:`_unit_rms` (same formula), else the module itself."""
    if x.dtype != torch.float32 or not _plain_rms_norm(module):
        return module(x)  # (hooks: e.g. DeepSpeed ZeRO-3 gathers the weight in one)
    return _unit_rms(x, module.variance_epsilon) * module.weight


_RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}


__all__ = ["KVDecoder", "has_forward_hooks", "supports"]
