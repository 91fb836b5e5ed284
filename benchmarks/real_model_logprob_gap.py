"""Engine-vs-trainer sampled-token log-prob gap of the vLLM engine on SmolLM2-135M-Instruct,
by dtype (the numbers in docs/vllm.md, "On a real model").

The policy is loaded in ``dtype`` from the converted GGUF folder, pushed into a
``VLLMEngine`` of the same dtype as in training, 8 ``builtin:addition`` questions (chat
template) get 8 samples of at most 32 tokens each, and the trainer's
``response_logprobs`` rescores them at the same temperature.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/real_model_logprob_gap.py bfloat16
"""
import sys, time, torch
from gspo_lightning.models.gguf import resolve_model
from gspo_lightning.models.loading import load_policy, load_tokenizer
from gspo_lightning.rollout import EngineSpec, SamplingParams, VLLMEngine
from gspo_lightning.rollout.hf import left_pad
from gspo_lightning.rollout.weight_sync import iter_policy_weights
from gspo_lightning.training.logprobs import response_logprobs
from gspo_lightning.data.tasks.addition import make_rows

dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
folder = resolve_model("builtin:smollm2-135m-instruct")
tok = load_tokenizer(folder)
policy = load_policy(folder, tok, dtype).eval()
rows = make_rows(8, seed=1)
texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True) for r in rows]
ps = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
engine = VLLMEngine(kv_cache_memory_gb=0.5)
t = time.time()
engine.start(EngineSpec(model_name_or_path=folder, dtype=dtype, prompt_length=max(map(len, ps)), response_length=32, seed=0,
                        eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=policy, tokenizer=tok))
engine.update_weights(iter_policy_weights(policy), 0)
print(f"start+push {time.time()-t:.1f}s", flush=True)
for temperature in (0.7, 1.0):
    gen = engine.generate(ps, 8, SamplingParams(32, temperature=temperature), seed=3)
    ids, mask = left_pad([p for p in ps for _ in range(8)], tok.pad_token_id, "cpu")
    with torch.no_grad():
        lp = response_logprobs(policy, torch.cat([ids, gen.completion_ids], 1), torch.cat([mask, gen.mask.long()], 1), ids.shape[1], temperature=temperature)[0]
    d = (lp.float()[gen.mask] - gen.logprobs.float()[gen.mask]).abs()
    seq = ((lp.float() - gen.logprobs.float()) * gen.mask).sum(1) / gen.mask.sum(1).clamp(min=1)
    print(f"{dtype} T={temperature}: {d.numel()} tokens, |engine - trainer| mean {d.mean():.2e} median {d.median():.2e} max {d.max():.2e}; "
          f"|sequence mean log-ratio| max {seq.abs().max():.2e}", flush=True)
engine.close()
