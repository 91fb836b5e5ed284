"""Peak memory per GPU of one GSPO training step, predicted without a GPU.

    python benchmarks/memory_model.py                          # the tables of docs/scaling.md
    python benchmarks/memory_model.py --model qwen3-8b --ranks 8 --strategy fsdp2 --response-length 4096 \\
        --micro-batch-size 4 --precision bf16                  # one case, with its breakdown
    python benchmarks/memory_model.py --check                  # against measured peaks on CPU (gloo)

Every term is what the code allocates, read from its code path (the function named beside
each term); sizes are bytes per rank at the peak of each phase of a steady-state step
(step 2 on: the optimizer state exists and the previous step's gradients are still
allocated, because ``zero_grad(set_to_none=True)`` runs at the start of each mini-batch):

- ``generate``: the HF engine (``rollout/hf.py``, ``rollout/kv_decode.py``): the prompts'
  prefill cache, the preallocated KV buffers of ``generation_batch_size`` rows x (prompt +
  response) x layers x kv heads x head_dim (or, for sharded policies, the growing
  ``DynamicCache``), fused weight copies (small models), the float32 logits of a decode step.
- ``logprobs``: the no-grad old-policy and reference passes (``module._logprobs_no_grad``):
  one decoder layer's working set, the KV cache when rows share a prompt
  (``logprobs.response_hidden_states``), and the head: float32 logits of all rows when they
  fit in ``MAX_UNCHUNKED_BYTES``, else ``logprob_chunk_size`` rows at a time, or the full
  N x T x V logits plus log-softmax and entropy temporaries on the full-logit path.
- ``update``: a micro-batch's forward and backward (``update.PolicyUpdater.run``): the
  tensors autograd saves per decoder layer (counted tensor by tensor for the Qwen3 / Llama
  layer, see :func:`layer_saved_bytes`), or only the layer inputs plus one recomputed layer
  with gradient checkpointing, the head path, the backward working set, FSDP2's gathered
  units; or, after the last backward, DDP's 64 MiB gradient buckets (``training/distributed.py``).
- ``optimizer step``: the gradients and AdamW's temporary (``foreach``, the GPU default:
  ``sqrt(exp_avg_sq)`` of every parameter at once; per parameter on CPU).

Strategies: ``ddp`` (everything replicated), ``fsdp2`` (``fully_shard`` per decoder layer
and at the root, ``module._fully_shard``: parameters, gradients and AdamW state 1/n; the
root unit — embeddings, final norm, head — stays gathered from forward to backward, plus
two layers in flight), ``zero3`` (DeepSpeed ZeRO-3 under Lightning: 1/n of bf16 weights and
gradients and of the fp32 master weights and Adam moments, 16 bytes a parameter, plus its
200M-element reduce bucket; modeled, not measured: it needs CUDA).

Choices that another change of issue 29 moves are flags; the default is the behaviour
after the fix, and the output says which was used:
``--fsdp2-full-logits`` (today FSDP2 forces the full-logit path), ``--fsdp2-unsharded-reference``
(today the reference is an unsharded copy per rank), ``--micro-batch-size 0`` /
``--generation-batch-size 0`` (today's ``null``: the whole local mini-batch / all rows).

The Qwen3 shapes are the published ones; parameter counts come from transformers'
``Qwen3ForCausalLM`` built on the ``meta`` device (nothing is downloaded), and the closed
form :func:`param_counts` is checked against them (tests/test_memory_model.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

GiB = 2**30
MiB = 2**20
MAX_UNCHUNKED_BYTES = 256 * MiB  # gspo_lightning/training/logprobs.py
DDP_BUCKET_BYTES = 64 * MiB  # gspo_lightning/training/distributed.py
FUSE_MAX_BYTES = 64 * MiB  # gspo_lightning/rollout/kv_decode.py
ZERO3_REDUCE_BUCKET = 200_000_000  # elements, Lightning's DeepSpeedStrategy default
STRATEGIES = ("ddp", "fsdp2", "zero3")


@dataclass(frozen=True)
class Shape:
    """A Qwen3 / Llama decoder-only shape."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 151936
    tied: bool = True
    qk_norm: bool = True  # Qwen3: RMSNorm over head_dim on q and k

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


# The published shapes (config.json of Qwen/Qwen3-0.6B, -1.7B, -8B)
QWEN3 = {
    "qwen3-0.6b": Shape("Qwen3-0.6B", 1024, 28, 16, 8, 128, 3072, tied=True),
    "qwen3-1.7b": Shape("Qwen3-1.7B", 2048, 28, 16, 8, 128, 6144, tied=True),
    "qwen3-8b": Shape("Qwen3-8B", 4096, 36, 32, 8, 128, 12288, tied=False),
}
# The CPU check's model: Qwen3-shaped, ~9M parameters, a vocabulary that makes the head matter
CHECK_SHAPE = Shape("check-9M", 256, 4, 4, 2, 64, 768, vocab=8000, tied=False)


def qwen3_config(shape: Shape):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, tie_word_embeddings=shape.tied, max_position_embeddings=40960,
    )


def meta_param_shapes(shape: Shape) -> list[tuple[int, ...]]:
    """Shapes of the distinct parameters of ``Qwen3ForCausalLM`` built on the meta device."""
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(qwen3_config(shape))
    return [tuple(p.shape) for p in model.parameters()]  # parameters() yields a tied weight once


def param_counts(shape: Shape) -> dict[str, int]:
    """Closed-form parameter counts: per layer, embeddings, head (0 when tied), final norm, total."""
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + (2 * shape.head_dim if shape.qk_norm else 0)
    embed = shape.vocab * h
    head = 0 if shape.tied else shape.vocab * h
    total = shape.layers * layer + embed + head + h
    return {"layer": layer, "embed": embed, "head": head, "norm": h, "total": total}


def shard_numel(shapes: list[tuple[int, ...]], ranks: int) -> int:
    """Elements per rank when every parameter is split on dim 0 (FSDP2 pads to a multiple of ranks)."""
    return sum(math.ceil(s[0] / ranks) * math.prod(s[1:]) for s in shapes)


@dataclass(frozen=True)
class Run:
    """One training configuration (the module's and engine's keys, per rank where noted)."""

    ranks: int = 8
    strategy: str = "ddp"
    precision: str = "bf16"  # bf16: dtype bfloat16 (bf16-true; ZeRO-3 keeps fp32 master weights); fp32
    gradient_checkpointing: bool = False
    prompt_length: int = 512
    response_length: int = 2048
    group_size: int = 8  # num_return_sequences_in_group
    rollout_batch_size: int = 64  # prompts per step, all ranks
    mini_batch_size: int = 128  # responses per optimizer step, all ranks
    micro_batch_size: Optional[int] = 4  # per rank; None: the whole local mini-batch (today's null)
    generation_batch_size: Optional[int] = 64  # per rank; None: all local rows (today's null)
    logprob_chunk_size: int = 512
    max_unchunked_bytes: int = MAX_UNCHUNKED_BYTES  # training/logprobs.py: larger response logits are chunked
    reference: bool = True  # a KL term needs the frozen reference
    old_pass: bool = True  # old_logprobs: recompute with more than one update per rollout
    engine: str = "hf"  # hf: generation in the trainer's memory; vllm: not counted here
    fsdp2_chunked_head: bool = True  # after the fix; today FSDP2 forces the full-logit path
    fsdp2_sharded_reference: bool = True  # after the fix; today an unsharded copy per rank
    foreach_optimizer: bool = True  # torch's AdamW default on GPUs (on CPU: one parameter at a time)

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    def local_rows(self) -> int:
        return self.rollout_batch_size // self.ranks * self.group_size

    def micro(self) -> int:
        mini = self.mini_batch_size // self.ranks
        return min(self.micro_batch_size or mini, mini)

    def gen_rows(self) -> int:
        rows = self.local_rows()
        per_chunk = max(1, (self.generation_batch_size or rows) // self.group_size)  # whole groups (hf.py)
        return min(per_chunk * self.group_size, rows)

    def full_logits(self) -> bool:
        return self.strategy == "fsdp2" and not self.fsdp2_chunked_head

    def reference_sharded(self) -> bool:
        return self.strategy == "zero3" or (self.strategy == "fsdp2" and self.fsdp2_sharded_reference)

    def validate(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"precision must be bf16 or fp32, got {self.precision!r}")
        if self.rollout_batch_size % self.ranks or self.mini_batch_size % self.ranks:
            raise ValueError(f"rollout_batch_size={self.rollout_batch_size} and mini_batch_size={self.mini_batch_size} "
                             f"must divide by ranks={self.ranks}")


# -- activations ----------------------------------------------------------------------------
def layer_saved_bytes(shape: Shape, b: int, queries: int, kv_tokens: int, mask_elements: int, grouped: bool = False) -> int:
    """Bytes autograd saves in one Qwen3 decoder layer (transformers 5, sdpa) for ``queries``
    query tokens attending over ``kv_tokens`` key tokens (summed over rows), ``b`` the dtype
    size, ``mask_elements`` the query x key positions of the padding mask (summed over rows).

    Counted tensor by tensor (checked with ``saved_tensors_hooks`` on a small layer):
    each hidden-size RMSNorm saves its float32 input, the normalized input in the dtype and
    (through the next linear) its output: ``(4 + 2b)`` per element; q_norm / k_norm save
    ``(4 + b)`` (rotary ``q * cos`` saves only cos); sdpa with a padding mask repeats k and v
    to every query head (``repeat_kv``) and saves q, k, v, its output and the float32
    log-sum-exp (its output is laid out so that o_proj's input is the same storage); sdpa
    turns the shared boolean padding mask into an additive mask in the dtype and saves it, in
    every layer; the SwiGLU MLP saves gate, act, up and their product; plus float32 rsqrt
    rows of each norm. ``grouped``: sdpa takes the key/value heads as they are (``enable_gqa``,
    what CPU runs use: gspo_lightning/models/cpu_attention.py), no repeated copies."""
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    repeated = q if shape.heads > shape.kv_heads and not grouped else kv
    t = queries
    norms = 2 * (4 + 2 * b) * t * h + (4 + b) * t * (q + kv if shape.qk_norm else 0)
    attention = b * t * q * 2 + 2 * b * kv_tokens * repeated + 4 * t * shape.heads + b * mask_elements  # q, out; k, v; lse
    mlp = 4 * b * t * i
    small = 4 * t * (2 + (shape.heads + shape.kv_heads if shape.qk_norm else 0))
    return norms + attention + mlp + small


def layer_working_bytes(shape: Shape, b: int, tokens: int) -> int:
    """A no-grad layer forward at its widest (the MLP: act, up and their product, beside the
    residual stream and the layer input)."""
    return 3 * b * tokens * shape.intermediate + 2 * b * tokens * shape.hidden + 4 * tokens * shape.hidden


def backward_working_bytes(shape: Shape, b: int, tokens: int) -> int:
    """Gradients in flight in one layer's backward: two residual-stream gradients, three
    intermediate-size gradients (the MLP's), one weight gradient before it is accumulated."""
    return 2 * b * tokens * shape.hidden + 3 * b * tokens * shape.intermediate + b * shape.hidden * shape.intermediate


# -- the model ------------------------------------------------------------------------------
@dataclass
class Prediction:
    shape: Shape
    run: Run
    states: dict = field(default_factory=dict)  # persistent bytes per rank
    phases: dict = field(default_factory=dict)  # phase -> {term: bytes} at that phase's peak (beyond states)

    def phase_total(self, phase: str) -> int:
        return sum(self.states.values()) + sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def peak(self) -> int:
        return self.phase_total(self.peak_phase)


def predict(shape: Shape, run: Run, param_shapes: Optional[list[tuple[int, ...]]] = None) -> Prediction:
    run.validate()
    b = run.dtype_bytes
    n = run.ranks
    counts = param_counts(shape)
    total = counts["total"]
    local = shard_numel(param_shapes, n) if param_shapes is not None and n > 1 else math.ceil(total / n)
    sharded = run.strategy in ("fsdp2", "zero3") and n > 1
    own = local if sharded else total
    out = Prediction(shape, run)

    # persistent state
    grads = b * own
    if run.strategy == "zero3":  # DeepSpeed: 2 (bf16 weight) + 2 (grad) + 12 (fp32 master + moments) = 16 per parameter
        out.states = {"weights": b * own, "optimizer": 8 * own + (4 * own if b == 2 else 0)}
    else:  # AdamW's exp_avg and exp_avg_sq in the parameters' dtype
        out.states = {"weights": b * own, "optimizer": 2 * b * own}
    if run.strategy == "ddp" and n > 1:
        # torch's DDP Reducer allocates flat gradient buckets for every parameter when it is built
        # (gradient_as_bucket_view=False): Lightning's wrapper, whose sync is off, and the policy's
        # own (distributed.PolicyForward), which syncs
        out.states["DDP reducer buckets"] = 2 * grads
    if run.reference:  # not trained: weights only
        out.states["reference"] = b * (own if sharded and run.reference_sharded() else total)
    rows = run.local_rows()
    S = run.prompt_length + run.response_length
    out.states["rollout"] = rows * S * 16 + rows * run.response_length * 4 * 4  # ids, masks; engine/old/ref log-probs, advantages

    # sharded units: the root (embeddings, final norm, head) is gathered at the first forward and
    # stays so until backward reshards it (no-grad forwards never do); gathering it holds the
    # all-gather buffer beside the unsharded parameters. Decoder layers are gathered one at a
    # time, with the next one prefetched; in backward a layer's unsharded grads wait for the
    # reduce-scatter beside its input buffer.
    root = counts["embed"] + counts["head"] + counts["norm"]
    layer = counts["layer"]
    gathered = b * max(2 * root, root + 3 * layer) if sharded else 0  # no-grad passes: at the root's all-gather
    gathered_fwd = b * root if sharded else 0  # the training forward's peak is at the head, layers resharded
    gathered_bwd = b * (root + 2 * layer + 2 * layer) if sharded else 0
    if run.strategy == "zero3" and n > 1:
        gathered_bwd += b * ZERO3_REDUCE_BUCKET

    # -- generate (HF engine; vLLM holds its own pool, not counted)
    if run.engine == "hf":
        g = run.gen_rows()
        prompts = g // run.group_size
        kv = shape.kv_dim
        prefill_cache = 2 * shape.layers * prompts * run.prompt_length * kv * b
        cache = 2 * shape.layers * g * (S - 1) * kv * b
        phase = {"grads (previous step)": grads, "prefill cache": prefill_cache, "KV cache": cache}
        if sharded:  # DynamicCache, repeated to every row in place, grows by torch.cat: one layer's old and new at once
            del phase["prefill cache"]
            phase["KV cache growth (cat)"] = 2 * g * (S - 1) * kv * b
            phase["gathered weights"] = gathered
        else:
            phase["attention bias"] = g * shape.kv_heads * (S - 1) * b
            proj = shape.layers * ((shape.q_dim + 2 * kv) * shape.hidden + 2 * shape.intermediate * shape.hidden)
            if proj * b <= FUSE_MAX_BYTES:  # _FusedLayer copies: q|k|v and gate|up concatenated
                phase["fused weight copies"] = proj * b
        phase["decode logits"] = g * shape.vocab * (4 + 4 + b)  # head output, float32 copy, exp weights
        phase["prefill layer"] = layer_working_bytes(shape, b, prompts * run.prompt_length)
        out.phases["generate"] = phase

    # -- micro-batch geometry
    m = run.micro()
    T = run.response_length
    N = m * T  # response positions through the head
    ckpt = run.gradient_checkpointing

    def logits_and_entropy(rows: int) -> int:
        """_HeadLogprobs.forward: float32 logits (the dtype's product is freed by .float() before the
        entropy), then exp and p * log p over at most 2**22 elements at a time."""
        entropy = 2 * 4 * min(rows, max(1, 2**22 // shape.vocab)) * shape.vocab
        return rows * shape.vocab * 4 + max(rows * shape.vocab * b if b == 2 else 0, entropy)

    def head_nograd() -> int:
        if run.full_logits():
            return N * shape.vocab * (b + (4 if b == 2 else 0) + 12)
        rows = N if N * shape.vocab * 4 <= run.max_unchunked_bytes else run.logprob_chunk_size
        return logits_and_entropy(rows)

    # -- logprobs (no grad): old policy and reference, one micro-batch at a time, rows in order
    if run.old_pass or run.reference:
        distinct = math.ceil(m / run.group_size) if m >= run.group_size else 1
        shares = distinct < m and not ckpt
        tokens = (distinct * run.prompt_length + m * (T - 1)) if shares else m * S
        decoder = layer_working_bytes(shape, b, tokens)
        if shares:  # the shared prompt's cache, expanded to every row and grown over the response
            decoder += 2 * shape.layers * m * (S - 1) * shape.kv_dim * b
        head = b * m * S * shape.hidden + b * N * shape.hidden + head_nograd()  # hidden states, response rows, head
        phase = {"grads (previous step)": grads, "decoder or head (no grad)": max(decoder, head)}
        if sharded:
            # the policy's root is still gathered from the generation (HF engine); a sharded
            # reference gathers its own root beside it
            policy_pass = b * (root + 2 * layer) if run.engine == "hf" else gathered
            reference_pass = b * root + gathered if run.reference and run.reference_sharded() else 0
            phase["gathered weights"] = max(policy_pass, reference_pass)
        out.phases["logprobs"] = phase

    # -- update: one micro-batch forward + backward
    distinct = m  # shuffled rows (several mini-batches or epochs): assume every row's prompt differs
    in_order = run.mini_batch_size == run.rollout_batch_size * run.group_size
    if in_order:
        distinct = math.ceil(m / run.group_size) if m >= run.group_size else 1
    shares = distinct < m and not ckpt
    shared = m * S * S + 2 * m * S * shape.head_dim * b  # the boolean 4-D mask, rotary cos/sin
    if shares:
        tp, tr = distinct * run.prompt_length, m * (T - 1)
        per_layer = (layer_saved_bytes(shape, b, tp, tp, distinct * run.prompt_length ** 2)
                     + layer_saved_bytes(shape, b, tr, m * (S - 1), tr * (S - 1)))
        tokens = tp + tr
        cache = 2 * shape.layers * m * (S - 1) * shape.kv_dim * b
    else:
        tokens = m * S
        per_layer = layer_saved_bytes(shape, b, tokens, tokens, m * S * S)
        cache = 0
    # with checkpointing each layer keeps its input, and backward recomputes one layer at a time
    saved = shape.layers * (b * tokens * shape.hidden if ckpt else per_layer)
    recomputed = per_layer if ckpt else 0
    final_norm = (4 + b) * tokens * shape.hidden
    hidden = b * tokens * shape.hidden + b * N * shape.hidden  # last hidden state and the response rows' copy
    V = shape.vocab
    head_grad = b * V * shape.hidden  # the head's weight gradient before it is accumulated
    if run.full_logits():
        head_fwd = N * V * (b + (4 if b == 2 else 0) + 12)  # logits, float32 copy, log-softmax, exp, p*logp
        head_bwd = N * V * 12 + head_grad  # saved log-softmax, gather's gradient, log-softmax's gradient
    elif N * V * 4 <= run.max_unchunked_bytes:
        head_fwd = logits_and_entropy(N)
        head_bwd = N * V * (4 + (b if b == 2 else 0)) + head_grad
    else:  # logprob_chunk_size rows at a time under checkpoint: recomputed in backward
        c = run.logprob_chunk_size
        head_fwd = logits_and_entropy(c)
        # each chunk's weight gradient is summed into autograd's buffer for the head weight: two at once
        head_bwd = c * V * (4 + 2 * (b if b == 2 else 0)) + 2 * head_grad
    bwd = backward_working_bytes(shape, b, tokens)
    saved += shared
    forward = max(saved + final_norm + cache, saved + final_norm + hidden + head_fwd) + gathered_fwd
    backward = max(saved + final_norm + hidden + head_bwd, saved + recomputed + bwd) + gathered_bwd
    activations = max(forward, backward)
    label = "activations (micro-batch %d x %d)" % (m, S) + (" + gathered weights" if sharded else "")
    phase = {label: activations}
    micros_per_mini = math.ceil(run.mini_batch_size // n / m)
    if micros_per_mini > 1:
        phase["grads (accumulating)"] = grads
    out.phases["update"] = phase
    if micros_per_mini == 1:  # the grads fill in as the activations drain: whichever is larger
        phase["grads (accumulating)"] = max(0, grads - activations)
    if run.strategy == "ddp" and n > 1:
        # after the last backward: the grads summed over ranks in flat buckets (distributed.GradientSync)
        largest = max(V * shape.hidden, shape.hidden * shape.intermediate)
        bucket = min(grads, DDP_BUCKET_BYTES + b * largest)
        if grads + bucket > sum(phase.values()):
            out.phases["update"] = {"grads": grads, "gradient bucket (after backward)": bucket}

    # -- optimizer step: grads, AdamW's foreach temporary (sqrt of exp_avg_sq), DDP's gradient bucket
    # AdamW's foreach path (the default on GPUs) takes the sqrt of every exp_avg_sq at once; the
    # per-parameter path (CPU) one parameter at a time
    largest = max(V * shape.hidden, shape.hidden * shape.intermediate)
    largest = math.ceil(largest / n) if sharded else largest
    temporary = own if run.foreach_optimizer else min(own, 2 * largest)  # sqrt, then its quotient
    out.phases["optimizer step"] = {"grads": grads, "optimizer temporary": (4 if run.strategy == "zero3" else b) * temporary}
    return out


def behaviour(run: Run) -> str:
    """Which side of the pending fixes a prediction assumes."""
    parts = []
    if run.strategy == "fsdp2":
        parts.append("full-logit head (today)" if run.full_logits() else "chunked head (after fix)")
        if run.reference:
            parts.append("sharded reference (after fix)" if run.fsdp2_sharded_reference else "unsharded reference (today)")
    parts.append(f"micro_batch_size={run.micro_batch_size}" if run.micro_batch_size else "micro_batch_size=null (today)")
    parts.append(f"generation_batch_size={run.generation_batch_size}" if run.generation_batch_size
                 else "generation_batch_size=null (today)")
    return ", ".join(parts)


def explain(pred: Prediction) -> str:
    lines = [f"{pred.shape.name}, {pred.run.ranks} rank(s), {pred.run.strategy}, {pred.run.precision}, "
             f"checkpointing {'on' if pred.run.gradient_checkpointing else 'off'}; {behaviour(pred.run)}"]
    unit, name = (GiB, "GiB") if pred.peak >= GiB else (MiB, "MiB")
    for k, v in pred.states.items():
        lines.append(f"  {k:<40} {v / unit:8.2f} {name}")
    for phase, terms in pred.phases.items():
        mark = "  <- peak" if phase == pred.peak_phase else ""
        lines.append(f"  [{phase}] total {pred.phase_total(phase) / unit:.2f} {name}{mark}")
        for k, v in terms.items():
            lines.append(f"    {k:<38} {v / unit:8.2f} {name}")
    return "\n".join(lines)


# -- tables ---------------------------------------------------------------------------------
def _git_stamp() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True).stdout.strip()
    except OSError:
        return "unknown"
    return commit + (" (with uncommitted changes)" if dirty else "")


def grid_table(run: Run, shapes=QWEN3, ranks=(1, 2, 4, 8)) -> str:
    param_shapes = {key: meta_param_shapes(s) for key, s in shapes.items()}
    head = "| model | params | ranks | " + " | ".join(f"{s} | {s} ckpt" for s in STRATEGIES) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(STRATEGIES))]
    for key, shape in shapes.items():
        total = sum(math.prod(s) for s in param_shapes[key])
        for n in ranks:
            cells = []
            for strategy in STRATEGIES:
                for ckpt in (False, True):
                    r = replace(run, ranks=n, strategy=strategy, gradient_checkpointing=ckpt)
                    try:
                        p = predict(shape, r, param_shapes[key])
                        cells.append(f"{p.peak / GiB:.1f} ({p.peak_phase[0]})")
                    except ValueError:
                        cells.append("—")
            lines.append(f"| {shape.name} | {total / 1e9:.2f}B | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fixes_table(shape: Shape, base: Run, lengths=(512, 2048, 4096), micros=(1, 4, 16)) -> str:
    """Today's defaults against the fixes, for FSDP2 at one shape."""
    shapes = meta_param_shapes(shape)
    lines = ["| response length | micro-batch | after the fixes | full-logit head | + unsharded reference | "
             "+ micro/generation batch null (today) |", "|---|---|---|---|---|---|"]
    for length in lengths:
        for micro in micros:
            after = replace(base, response_length=length, micro_batch_size=micro)
            a = predict(shape, after, shapes)
            f = predict(shape, replace(after, fsdp2_chunked_head=False), shapes)
            u = predict(shape, replace(after, fsdp2_chunked_head=False, fsdp2_sharded_reference=False), shapes)
            today = predict(shape, replace(after, fsdp2_chunked_head=False, fsdp2_sharded_reference=False,
                                           micro_batch_size=None, generation_batch_size=None), shapes)
            cells = [f"{p.peak / GiB:.1f} ({p.peak_phase})" for p in (a, f, u)]
            today_cell = f"{today.peak / GiB:.1f} ({today.peak_phase})" if micro == micros[0] else "″"
            lines.append(f"| {length} | {micro} | " + " | ".join(cells) + f" | {today_cell} |")
    return "\n".join(lines)


def tables(run: Run) -> str:
    out = [f"Generated by `python benchmarks/memory_model.py` at commit {_git_stamp()}.", "",
           f"Per-GPU peak in GiB of one steady-state step (letter: the phase of the peak, g = generate, "
           f"l = no-grad log-prob passes, u = update, o = optimizer step). Config: {run.precision}, prompt "
           f"{run.prompt_length} + response {run.response_length} tokens, {run.rollout_batch_size} prompts x "
           f"{run.group_size} responses per step, mini_batch_size {run.mini_batch_size} (all ranks), "
           f"micro_batch_size {run.micro_batch_size} and generation_batch_size {run.generation_batch_size} (per rank), "
           f"HF engine, {'with' if run.reference else 'without'} the frozen reference (KL), old-policy pass "
           f"{'on' if run.old_pass else 'off'}; FSDP2 with the chunked head and the sharded reference (after the fixes).",
           "", grid_table(run), "",
           f"Qwen3-8B, FSDP2, 8 ranks, {run.precision}, gradient checkpointing on and the vLLM engine (as in "
           f"configs/gsm8k_qwen3.yaml; vLLM's own pool, gpu_memory_utilization x the GPU, comes on top), "
           f"the same batch: the fixes of issue 29 one at a time "
           f"(peak GiB and its phase; the last column: micro_batch_size and generation_batch_size null as well, "
           f"one value per length).", "",
           fixes_table(QWEN3["qwen3-8b"], replace(run, ranks=8, strategy="fsdp2", gradient_checkpointing=True,
                                                  engine="vllm"))]
    return "\n".join(out)


# -- the CPU check --------------------------------------------------------------------------
CHECK_CASES = {
    # name: (ranks, strategy, Run overrides); every case bf16-free fp32 on CPU unless named
    "1 rank": (1, "ddp", {}),
    "1 rank, checkpointing": (1, "ddp", {"gradient_checkpointing": True}),
    "1 rank, bf16": (1, "ddp", {"precision": "bf16"}),
    "1 rank, chunked head": (1, "ddp", {"max_unchunked_bytes": MiB, "logprob_chunk_size": 64}),
    # rows in order, so a micro-batch's rows share their prompts (logprobs.response_hidden_states)
    "1 rank, one mini-batch": (1, "ddp", {"mini_batch_size": 16, "micro_batch_size": 8, "old_pass": False}),
    "2 ranks DDP": (2, "ddp", {}),
    "2 ranks FSDP2 (today: full logits, unsharded ref)": (2, "fsdp2", {"fsdp2_chunked_head": False,
                                                                        "fsdp2_sharded_reference": False}),
}
CHECK_RUN = Run(ranks=1, precision="fp32", prompt_length=32, response_length=96, group_size=4, rollout_batch_size=4,
                mini_batch_size=8, micro_batch_size=4, generation_batch_size=8, logprob_chunk_size=512,
                foreach_optimizer=False)


def check_reward(prompts, completions, **columns) -> list[float]:
    """The check's reward: the share of digit characters (varies inside a group, so advantages are non-zero)."""
    return [sum(ch.isdigit() for ch in text) / (1 + len(text)) for text in completions]


def build_check_model(folder: Path, shape: Shape = CHECK_SHAPE, seed: int = 1234, max_position_embeddings: int = 1024) -> Path:
    """A random Qwen3 model of ``shape`` with the BPE tokenizer of ``builtin:tiny-gsm8k``, saved to ``folder``."""
    import torch
    from transformers import Qwen3ForCausalLM

    from gspo_lightning.models.tiny import build_tokenizer, get_spec

    if (folder / "config.json").is_file():
        return folder
    tokenizer = build_tokenizer(get_spec("builtin:tiny-gsm8k"))
    config = qwen3_config(shape)
    config.max_position_embeddings = max_position_embeddings
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_check(names, workdir: Path, reuse: bool = False) -> list[dict]:
    child = Path(__file__).with_name("_memory_child.py")
    model_dir = build_check_model(workdir / "model")
    results = []
    for name in names:
        ranks, strategy, overrides = CHECK_CASES[name]
        run = replace(CHECK_RUN, ranks=ranks, strategy=strategy, **overrides)
        out = workdir / (name.replace(" ", "_").replace(",", "").replace(":", "").replace("(", "").replace(")", "") + ".json")
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
        cmd = [sys.executable, *launcher, str(child),
               "--config", json.dumps(asdict(run)), "--out", str(out),
               "--model_dir", str(model_dir)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = None if reuse and out.is_file() else subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
        if proc is not None and proc.returncode != 0:
            raise RuntimeError(f"{name}: the measuring run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        measured = json.loads(out.read_text())
        pred = predict(CHECK_SHAPE, run, meta_param_shapes(CHECK_SHAPE))
        row = {"case": name, "run": asdict(run), "behaviour": behaviour(run), "measured": measured,
               "predicted": {phase: pred.phase_total(phase) for phase in pred.phases},
               "predicted_peak": pred.peak, "measured_peak": measured["peak"]}
        row["error"] = pred.peak / measured["peak"] - 1
        results.append(row)
        print(f"{name}: predicted {pred.peak / MiB:.1f} MiB ({pred.peak_phase}), measured {measured['peak'] / MiB:.1f} MiB "
              f"({measured['peak_phase']}), error {row['error']:+.1%}", flush=True)
    return results


def check_table(results: list[dict]) -> str:
    lines = ["| case | phase | predicted MiB | measured MiB | error |", "|---|---|---|---|---|"]
    for r in results:
        for phase, measured in r["measured"]["phases"].items():
            predicted = r["predicted"].get(phase)
            if predicted is None:
                continue
            lines.append(f"| {r['case']} | {phase} | {predicted / MiB:.1f} | {measured / MiB:.1f} | "
                         f"{predicted / measured - 1:+.1%} |")
        lines.append(f"| **{r['case']}** | **peak** | **{r['predicted_peak'] / MiB:.1f}** | "
                     f"**{r['measured_peak'] / MiB:.1f}** | **{r['error']:+.1%}** |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(QWEN3), help="one case with its breakdown (else: the tables)")
    parser.add_argument("--ranks", type=int, default=Run.ranks)
    parser.add_argument("--strategy", choices=STRATEGIES, default=Run.strategy)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=Run.precision)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--prompt-length", type=int, default=Run.prompt_length)
    parser.add_argument("--response-length", type=int, default=Run.response_length)
    parser.add_argument("--group-size", type=int, default=Run.group_size)
    parser.add_argument("--rollout-batch-size", type=int, default=Run.rollout_batch_size, help="prompts per step, all ranks")
    parser.add_argument("--mini-batch-size", type=int, default=Run.mini_batch_size, help="responses, all ranks")
    parser.add_argument("--micro-batch-size", type=int, default=Run.micro_batch_size, help="per rank; 0: null (today's default)")
    parser.add_argument("--generation-batch-size", type=int, default=Run.generation_batch_size,
                        help="per rank; 0: null (today's default)")
    parser.add_argument("--logprob-chunk-size", type=int, default=Run.logprob_chunk_size)
    parser.add_argument("--no-reference", action="store_true", help="no KL term: no frozen reference")
    parser.add_argument("--no-old-pass", action="store_true", help="old_logprobs: engine (no recompute pass)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--fsdp2-full-logits", action="store_true", help="today's FSDP2 log-prob path")
    parser.add_argument("--fsdp2-unsharded-reference", action="store_true", help="today's FSDP2 reference")
    parser.add_argument("--check", action="store_true", help="measure the CPU cases and compare")
    parser.add_argument("--cases", nargs="+", default=list(CHECK_CASES), help="with --check")
    parser.add_argument("--workdir", default="/tmp/memory_model_check")
    parser.add_argument("--json", help="write the results (with --check) here")
    parser.add_argument("--reuse", action="store_true", help="with --check: reuse measurements found in --workdir")
    args = parser.parse_args(argv)
    run = Run(
        ranks=args.ranks, strategy=args.strategy, precision=args.precision, gradient_checkpointing=args.gradient_checkpointing,
        prompt_length=args.prompt_length, response_length=args.response_length, group_size=args.group_size,
        rollout_batch_size=args.rollout_batch_size, mini_batch_size=args.mini_batch_size,
        micro_batch_size=args.micro_batch_size or None, generation_batch_size=args.generation_batch_size or None,
        logprob_chunk_size=args.logprob_chunk_size, reference=not args.no_reference, old_pass=not args.no_old_pass,
        engine=args.engine, fsdp2_chunked_head=not args.fsdp2_full_logits,
        fsdp2_sharded_reference=not args.fsdp2_unsharded_reference,
    )
    if args.check:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run_check(args.cases, workdir, reuse=args.reuse)
        print(f"\nCPU check at commit {_git_stamp()}: `python benchmarks/memory_model.py --check`\n")
        print(check_table(results))
        if args.json:
            Path(args.json).write_text(json.dumps({"commit": _git_stamp(), "results": results}, indent=1))
        return 0
    if args.model:
        print(explain(predict(QWEN3[args.model], run, meta_param_shapes(QWEN3[args.model]))))
        return 0
    print(tables(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
