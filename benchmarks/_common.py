"""Pieces the benchmark parent and children share: the models, the prompts, the reward,
the FLOP count, and the memory, timing and contention probes.

Nothing here imports gspo_lightning or trl at module level, so either child pays only for
its own framework's imports.
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class BenchConfig:
    """One TRL measurement (``_trl_child.py``); the ``gspo fit`` config of the same cell
    carries the same numbers (``bench_grid.gspo_config``)."""

    size: str  # the grid cell's name
    model_dir: str  # a saved Hugging Face folder (built once by the parent)
    prompts_file: str  # jsonl with a "prompt" column
    prompts_per_step: int
    group_size: int
    response_length: int
    steps: int
    warmup: int
    lr: float = 1e-6
    threads: int = 2
    seed: int = 0
    out_dir: str = ""
    engine: str = "hf"  # "hf": TRL's model.generate; "vllm": TRL's colocated vLLM (vllm_mode="colocate")
    kv_cache_gib: int = 1  # vLLM's KV cache on CPU (VLLM_CPU_KVCACHE_SPACE takes whole GiB), as our engine's
    prompt_length: int = 64  # longest prompt in tokens (vLLM's max_model_len is this plus response_length)
    precision: str = "fp32"  # "bf16": autocast to bfloat16 on the CPU (TRL's bf16=True; ours: precision bf16-mixed)

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str) -> "BenchConfig":
        return cls(**json.loads(Path(path).read_text()))


def bench_reward(prompts, completions, **kwargs) -> list[float]:
    """Deterministic and cheap: the share of digit characters in the completion.

    Random policies give different values inside a group, so advantages are non-zero and
    both trainers do a real update (TRL and gspo-lightning call it the same way)."""
    return [sum(ch.isdigit() for ch in text) / (1 + len(text)) for text in completions]


def write_prompts(tokenizer, source: str, out: Path, tokens: int, count: int) -> dict:
    """The first ``count`` GSM8K questions cut to their first ``tokens`` tokens (decoded back
    to text), as ``{"prompt": text}`` rows: every cell of the grid gets prompts of about the
    same length in tokens, whatever its vocabulary."""
    rows, lengths = [], []
    with open(source) as handle:
        for line in handle:
            ids = tokenizer(json.loads(line)["question"], add_special_tokens=False)["input_ids"][:tokens]
            text = tokenizer.decode(ids).strip()
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if 0 < n <= tokens:
                rows.append({"prompt": text})
                lengths.append(n)
            if len(rows) == count:
                break
    if len(rows) < count:
        raise RuntimeError(f"only {len(rows)} prompts in {source}, {count} wanted")
    with open(out, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return {"prompts": len(rows), "prompt_tokens_mean": statistics.mean(lengths), "prompt_tokens_max": max(lengths)}


# -- models ------------------------------------------------------------------------------
# Vocabularies: BPE trained on GSM8K. 32k pads an 8k BPE to 32,000 rows, as real 32k models
# carry rows the text never uses: compute and memory follow the padded size.
VOCABS = {
    "100": dict(bpe_vocab_size=100),
    "2k": dict(bpe_vocab_size=2000),
    "32k": dict(bpe_vocab_size=8000, vocab_size=32000),
}
# Model sizes by decoder (non-embedding) parameters; embeddings are tied to the head and
# add vocab x hidden on top (the tables give the total).
MODEL_SIZES = {
    # the quickstart's shape: so small that dispatch, not arithmetic, sets the step time
    "0.07M": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "0.6M": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2),
    "25M": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4),
}


def build_bench_model(vocab: str, size: str, folder: Path, seed: int) -> dict:
    """Build a Qwen2 model of ``size`` with the ``vocab`` tokenizer from ``seed`` and save it
    as a Hugging Face folder both frameworks load. Returns its shape for the FLOP count."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from gspo_lightning.models.tiny import TinyModelSpec, build_config, build_tokenizer

    spec = TinyModelSpec(tokenizer="bpe", corpus="gsm8k", model_type="qwen2", max_position_embeddings=1024,
                         **VOCABS[vocab], **MODEL_SIZES[size])
    tokenizer = build_tokenizer(spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_config(spec, tokenizer), dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # the tokenizer trap (DESIGN.md): reload with the explicit class and check a round trip
    reloaded = PreTrainedTokenizerFast.from_pretrained(folder)
    text = "Natalia sold 48 clips in April."
    if reloaded.decode(reloaded(text)["input_ids"]) != text:
        raise RuntimeError(f"tokenizer of {folder} does not round-trip {text!r}")
    config = model.config
    embedding = config.vocab_size * config.hidden_size
    total = sum(p.numel() for p in model.parameters())
    return {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "layers": config.num_hidden_layers,
            "params_m": total / 1e6, "decoder_params_m": (total - embedding) / 1e6,
            "decoder_matmul_params": _decoder_matmul_params(model), "tokenizer": reloaded}


def _decoder_matmul_params(model) -> int:
    """Weights of the decoder's linear layers: 2 FLOPs each per token in a forward."""
    import torch

    return sum(m.weight.numel() for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear))


def step_flops(shape: dict, prompts: int, group: int, prompt_tokens: float, response_tokens: int) -> dict:
    """Model FLOPs (fp32 matmuls) one step needs, counting each prompt once:

    generation: each prompt prefilled once (decoder; the head at its last position), then
    ``response_tokens - 1`` decode steps of ``prompts x group`` rows (decoder, attention over
    the context so far, head); training: forward + backward (3x the forward) of the decoder
    over each prompt once and every response, of the attention of those tokens over their
    context, and of the head over the response positions only.
    """
    dec = 2 * shape["decoder_matmul_params"]  # per token
    head = 2 * shape["hidden_size"] * shape["vocab_size"]  # per projected position
    attn = 4 * shape["hidden_size"] * shape["layers"]  # per token per context position (QK^T and AV)
    rows = prompts * group
    p, r = prompt_tokens, response_tokens
    prompt_pass = prompts * (p * dec + attn * p * (p + 1) / 2)
    prefill = prompt_pass + prompts * head
    decode = rows * sum(dec + head + attn * (p + t + 1) for t in range(1, r))
    responses = rows * sum(dec + head + attn * (p + t + 1) for t in range(r))
    train = 3 * (prompt_pass + responses)
    return {"generate": prefill + decode, "train": train, "total": prefill + decode + train}


def matmul_rate(threads: int, seconds: float = 2.0) -> float:
    """Best fp32 matmul rate (FLOP/s) of this machine at ``threads`` threads, over square
    and step-shaped products (the FLOP limit of a step divides by it)."""
    import time

    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for m, k, n in [(1024, 1024, 1024), (2048, 512, 1536), (2048, 512, 8192), (1024, 128, 2048)]:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b  # warm-up
        deadline = time.perf_counter() + seconds / 4
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * m * k * n / (time.perf_counter() - t))
    return best


# -- contention ------------------------------------------------------------------------
def machine_busy_s() -> float:
    """CPU seconds all processes of the machine have used (from /proc/stat), all cores together."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return float("nan")
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class StepClock:
    """Wall time, own CPU time, and the CPU time other processes took, per step.

    The machine is shared: when other processes run during a step, the step is slower for
    reasons that have nothing to do with the framework. ``contention`` is the share of
    all cores that other processes used during the step; the parent reports medians over
    the steps where it stayed low (and over all steps)."""

    def __init__(self) -> None:
        self.ncpu = os.cpu_count() or 1
        self.mark()

    def mark(self) -> None:
        import time

        self.wall, self.cpu, self.busy = time.perf_counter(), time.process_time(), machine_busy_s()

    def lap(self, result: "ChildResult") -> None:
        import time

        wall, cpu, busy = time.perf_counter() - self.wall, time.process_time() - self.cpu, machine_busy_s() - self.busy
        result.step_wall_s.append(wall)
        result.step_cpu_s.append(cpu)
        other = max(0.0, busy - cpu)
        result.step_contention.append(other / (wall * self.ncpu) if wall > 0 else 0.0)


# -- memory ------------------------------------------------------------------------------
def _status_kib(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """VmHWM (since the last reset), falling back to ru_maxrss."""
    hwm = _status_kib("VmHWM")
    return hwm / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class ChildResult:
    framework: str
    size: str
    step_wall_s: list[float] = field(default_factory=list)  # per optimizer step, end-to-end
    step_cpu_s: list[float] = field(default_factory=list)  # process CPU time (all threads) per step
    step_contention: list[float] = field(default_factory=list)  # share of the cores other processes used
    phases: dict[str, list[float]] = field(default_factory=dict)  # phase -> per-step seconds
    response_length_mean: list[float] = field(default_factory=list)
    baseline_rss_mib: float = 0.0  # after model load / trainer setup, before the first step
    load_peak_rss_mib: float = 0.0  # high-water mark of imports, loading and setup (before step 1)
    train_peak_rss_mib: float = 0.0  # high-water mark from the first step to the last
    rollout_peak_rss_mib: list[float] = field(default_factory=list)  # per step: generate + score + batch building
    update_peak_rss_mib: list[float] = field(default_factory=list)  # per step: log-prob passes + update
    process_peak_rss_mib: float = 0.0  # max(load_peak_rss_mib, train_peak_rss_mib)
    peak_reset: bool = False
    setup_s: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def add_phase(self, name: str, value: float) -> None:
        self.phases.setdefault(name, []).append(float(value))

    def finish_memory(self) -> None:
        self.train_peak_rss_mib = max([peak_rss_mib(), *self.rollout_peak_rss_mib, *self.update_peak_rss_mib])

    def write(self, out_dir: str) -> None:
        # (ru_maxrss is reset together with VmHWM, so it cannot give the whole-process peak)
        self.process_peak_rss_mib = max(self.load_peak_rss_mib, self.train_peak_rss_mib)
        Path(out_dir, "result.json").write_text(json.dumps(asdict(self), indent=1))


def versions() -> dict[str, str]:
    import platform

    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "torch_threads": str(torch.get_num_threads()), "cpu_count": str(os.cpu_count())}
    for name in ("lightning", "trl", "accelerate"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out
