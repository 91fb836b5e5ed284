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
from typing import Optional

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


def _sharded(model: nn.Module) -> bool:
    """FSDP gathers a layer's weights in that layer's forward; calling its submodules
    directly would see shards."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return True
    return any(type(m).__name__.startswith(("FullyShardedDataParallel", "FSDP")) for m in model.modules())


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
        self.bias = torch.zeros((rows, 1, 1, width + new_tokens), dtype=dtype, device=mask.device)
        self.bias[:, 0, 0, :width].masked_fill_(mask == 0, torch.finfo(dtype).min)  # left padding
        self.position = mask.sum(-1) - 1  # (rows,) position of the last prompt token
        # cos/sin of every position the response will use, computed once, shaped to broadcast
        # over (rows, kv_heads, heads, head_dim); rotate_half(x) * sin == roll(x, half) * signed_sin
        positions = torch.arange(int(self.position.max()) + new_tokens + 2, device=mask.device)[None]
        cos, sin = self.decoder.rotary_emb(self.keys[0] if self.keys else mask.float(), positions)
        half = cos.shape[-1] // 2
        sign = torch.ones(cos.shape[-1], dtype=sin.dtype, device=sin.device)
        sign[:half] = -1
        self.cos = cos[0][:, None, None, :]
        self.signed_sin = (sin[0] * sign)[:, None, None, :]
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
        rows = tokens.shape[0]
        cos = self.cos[self.position]  # (rows, 1, 1, head_dim)
        signed_sin = self.signed_sin[self.position]
        bias = self.bias[..., :self.length]
        hidden = self.decoder.embed_tokens(tokens)  # (rows, hidden)
        for index, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            head_dim = attn.head_dim
            x = _norm(layer.input_layernorm, hidden)
            keys, values = self.keys[index], self.values[index]
            kv_heads = keys.shape[1]
            fused = self.fused[index] if self.fused is not None else None
            if fused is not None and fused.qkv is not None:
                q, k, v = F.linear(x, *fused.qkv).split(fused.qkv_sizes, dim=-1)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = q.view(rows, kv_heads, -1, head_dim)  # query heads grouped by their key/value head
            k = k.view(rows, kv_heads, 1, head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotary embedding
                q, k = attn.q_norm(q), attn.k_norm(k)
            groups = q.shape[2]
            qk = torch.cat((q, k), dim=2)  # one rotary embedding for both
            qk = torch.addcmul(qk * cos, qk.roll(self.half, dims=-1), signed_sin)
            keys[:, :, column] = qk[:, :, groups]
            values[:, :, column] = v.view(rows, kv_heads, head_dim)
            scores = torch.matmul(qk[:, :, :groups], keys[:, :, :self.length].transpose(-1, -2))
            scores = torch.addcmul(bias, scores, _scalar(attn.scaling, scores))  # scaling * (q.k) + mask
            probs = torch.softmax(scores, dim=-1) if scores.dtype == torch.float32 else \
                torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
            out = torch.matmul(probs, values[:, :, :self.length]).view(rows, -1)
            hidden = hidden + attn.o_proj(out)
            x = _norm(layer.post_attention_layernorm, hidden)
            if fused is not None and fused.gate_up is not None:
                gate, up = F.linear(x, fused.gate_up).chunk(2, dim=-1)
                hidden = hidden + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
            else:
                hidden = hidden + layer.mlp(x)
        return self.head(_norm(self.decoder.norm, hidden)).float()


# Fused copies of the q/k/v and gate/up weights (rebuilt for every generation: the weights
# change between rollouts) save three matmul calls per layer and step, which pays where a
# call costs more than its arithmetic; the copies cost memory, so only small models get them.
_FUSE_MAX_BYTES = 64 * 2**20


def _fusion_pays(decoder: nn.Module) -> bool:
    size = 0
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)):
            if type(proj) is nn.Linear:
                size += proj.weight.numel() * proj.weight.element_size()
    return size <= _FUSE_MAX_BYTES


@dataclass
class _FusedLayer:
    qkv: Optional[tuple[Tensor, Optional[Tensor]]]  # (weight, bias) of q|k|v, or None: separate calls
    qkv_sizes: tuple[int, int, int]
    gate_up: Optional[Tensor]  # weight of gate|up, or None: the MLP module itself

    @staticmethod
    def build(layer: nn.Module) -> "_FusedLayer":
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv, sizes = None, (0, 0, 0)
        if all(_plain_linear(p) for p in projections):  # no adapters, no hooks of their own
            weight = torch.cat([p.weight for p in projections]).detach()
            bias = None
            if any(p.bias is not None for p in projections):
                bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                                  for p in projections]).detach()
            qkv, sizes = (weight, bias), tuple(p.out_features for p in projections)
        gate_up = None
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        if (_plain_linear(gate) and _plain_linear(up) and gate.bias is None and up.bias is None
                and hasattr(mlp, "down_proj") and hasattr(mlp, "act_fn") and not _hooked(mlp)):
            gate_up = torch.cat([gate.weight, up.weight]).detach()
        return _FusedLayer(qkv, sizes, gate_up)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _plain_linear(module) -> bool:
    return type(module) is nn.Linear and not _hooked(module)


_SCALARS: dict = {}


def _scalar(value: float, like: Tensor) -> Tensor:
    """A cached 0-d tensor (addcmul takes tensors)."""
    key = (value, like.dtype, like.device)
    if key not in _SCALARS:
        _SCALARS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return _SCALARS[key]


def _norm(module: nn.Module, x: Tensor) -> Tensor:
    """A Llama-style RMSNorm as one fused op in float32 (same formula), else the module itself."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None or x.dtype != torch.float32 or type(module).__name__ not in _RMS_NORMS or _hooked(module):
        return module(x)  # (hooks: e.g. DeepSpeed ZeRO-3 gathers the weight in one)
    return F.rms_norm(x, module.weight.shape, module.weight, eps)


_RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}


__all__ = ["KVDecoder", "supports"]
