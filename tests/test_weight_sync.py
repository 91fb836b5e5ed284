"""The vLLM engine's CUDA-free parts, on CPU with fake vLLM objects: weight buckets,
name mapping, gathering of sharded parameters, sync skipping, output conversion, and the
start-up errors when vLLM or CUDA is missing."""

import socket
import sys
import types
import weakref
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gspo_lightning.rollout import vllm as vllm_engine
from gspo_lightning.rollout.engine import Generation, RolloutEngine, SamplingParams
from gspo_lightning.rollout.vllm import (
    VLLMEngine, check_vllm_available, choose_logprobs_mode, infer_max_model_len, launcher_env,
    request_seeds, sampling_kwargs, slice_generation, tensor_parallel_groups,
)
from gspo_lightning.rollout.weight_sync import (
    WeightSync, engine_name, full_nbytes, iter_buckets, outputs_to_generation, plan_buckets, sharding_kind,
)


# -- buckets and names --------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [1, 10, 25, 1000])
def test_plan_buckets_respects_the_limit_and_covers_everything_once_in_order(limit):
    sizes = [4, 12, 7, 30, 1, 1, 9, 16]
    buckets = plan_buckets(sizes, limit)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    for bucket in buckets:
        assert sum(sizes[i] for i in bucket) <= limit or len(bucket) == 1  # an oversize tensor goes alone
    if limit == 1000:
        assert len(buckets) == 1


def test_plan_buckets_rejects_a_zero_limit():
    with pytest.raises(ValueError, match="bucket"):
        plan_buckets([1], 0)


@pytest.mark.parametrize("name, expected", [
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    ("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("model.layers.3._checkpoint_wrapped_module.mlp.down_proj.weight", "model.layers.3.mlp.down_proj.weight"),
    ("module.model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("_orig_mod.lm_head.weight", "lm_head.weight"),
    ("module._orig_mod.model.norm.weight", "model.norm.weight"),
    ("model.submodule.weight", "model.submodule.weight"),  # only a leading "module." is a wrapper
])
def test_engine_name_strips_wrappers(name, expected):
    assert engine_name(name) == expected


def test_buckets_of_a_real_model_are_its_hf_parameters_in_order(tiny_echo):
    model, _ = tiny_echo
    expected = [(n, p) for n, p in model.named_parameters()]
    limit = 4096
    buckets = list(iter_buckets(model, limit))
    got = [pair for bucket in buckets for pair in bucket]
    assert [n for n, _ in got] == [n for n, _ in expected]  # tied lm_head appears once (as embed_tokens)
    for (_, sent), (_, param) in zip(got, expected):
        assert torch.equal(sent, param) and not sent.requires_grad
    for bucket in buckets:
        assert sum(full_nbytes(t) for _, t in bucket) <= limit or len(bucket) == 1
    assert len(buckets) > 1 and sharding_kind(model) == "plain"


# -- gathering sharded parameters -----------------------------------------------------------------

def test_params_with_full_tensor_are_gathered_one_at_a_time():
    model = nn.Linear(3, 2)
    calls = []
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        param.full_tensor = (lambda n=name: calls.append(n) or full[n] * 1)
    assert sharding_kind(model) == "dtensor"
    buckets = list(iter_buckets(model, 1))  # one parameter per bucket
    assert calls == ["weight", "bias"] and [len(b) for b in buckets] == [1, 1]
    assert torch.equal(buckets[0][0][1], full["weight"])


@pytest.fixture
def gloo_world():
    """A one-process gloo group: FSDP1 / FSDP2 gathers run for real on CPU."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def two_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_fsdp2_dtensor_parameters_are_gathered(gloo_world):
    from torch.distributed.fsdp import fully_shard

    model, reference = two_layers()
    fully_shard(model[0])
    fully_shard(model)
    assert sharding_kind(model) == "dtensor"
    got = [(n, t) for bucket in iter_buckets(model, 20) for n, t in bucket]
    assert [n for n, _ in got] == list(reference)
    for name, tensor in got:
        assert type(tensor) is torch.Tensor and torch.equal(tensor, reference[name])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_units_are_summoned_one_at_a_time(gloo_world, use_orig_params):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model, reference = two_layers()
    wrapped = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                   use_orig_params=use_orig_params)
    assert sharding_kind(wrapped) == "fsdp1"
    got = {}
    for bucket in iter_buckets(wrapped, 1 << 20):
        for name, tensor in bucket:
            got[name] = tensor.clone()  # valid only until the next bucket
    assert list(got) == list(reference)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, reference[name])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_root_around_the_lightning_module_is_used_for_the_policy(gloo_world, use_orig_params):
    """Lightning's FSDPStrategy wraps the whole LightningModule: the policy's outer
    parameters (here ``norm``) live in the root unit, above the policy."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    policy.add_module("norm", nn.LayerNorm(2))
    reference = {n: p.detach().clone() for n, p in policy.named_parameters()}
    lightning_module = nn.Module()
    lightning_module.policy = policy
    lightning_module.reference = nn.Linear(2, 2)  # also in the root: must not be sent
    root = FSDP(lightning_module, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                use_orig_params=use_orig_params)
    inner = root.module.policy
    module = SimpleNamespace(_trainer=SimpleNamespace(strategy=SimpleNamespace(model=root)))
    assert vllm_engine.fsdp1_root(module, inner) is root
    assert vllm_engine.fsdp1_root(SimpleNamespace(_trainer=None), inner) is None
    got = {}
    for bucket in iter_buckets(inner, 1 << 20, root=root):
        for name, tensor in bucket:
            got[name] = tensor.clone()
    assert sorted(got) == sorted(reference)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, reference[name])


def _sharded_worker(rank, world_size, port, out_dir):
    """One rank of a real 2-process gloo world: shard, stream, compare with the unsharded model."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    results = {}
    for kind in ("fsdp2", "fsdp1", "fsdp1-orig"):
        torch.manual_seed(0)
        policy = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        policy.add_module("norm", nn.LayerNorm(2))
        reference = {n: p.detach().clone() for n, p in policy.named_parameters()}
        root = None
        if kind == "fsdp2":
            fully_shard(policy[0])
            fully_shard(policy[1])
            fully_shard(policy)
            model = policy
            local = sum(p.to_local().numel() for p in model.parameters())
        else:  # the layout of Lightning's FSDPStrategy: a root unit around the LightningModule
            container = nn.Module()
            container.policy = policy
            root = FSDP(container, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                        use_orig_params=kind == "fsdp1-orig")
            model = root.module.policy
            local = sum(p.numel() for p in root.parameters())  # flat shards (padded)
        got = {n: t.clone() for bucket in iter_buckets(model, 40, root=root) for n, t in bucket}
        ok = sorted(got) == sorted(reference) and all(torch.equal(got[n], reference[n]) for n in reference)
        results[kind] = (ok, local, sum(t.numel() for t in reference.values()))
    torch.save(results, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_stream_full_weights_from_real_shards(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_sharded_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        for kind, (ok, local, full) in torch.load(tmp_path / f"{rank}.pt").items():
            assert ok, f"{kind}: rank {rank} streamed wrong weights"
            assert local < full, f"{kind}: the parameters were not sharded"


def test_deepspeed_zero3_parameters_are_gathered_per_bucket(monkeypatch):
    model, reference = two_layers()
    gathered = []

    class GatheredParameters:  # the deepspeed.zero API: gathers on enter, re-partitions on exit
        def __init__(self, params, modifier_rank=None):
            assert modifier_rank is None
            self.params = params

        def __enter__(self):
            gathered.append([p.ds_name for p in self.params])
            for p in self.params:
                p.data = p.ds_full

        def __exit__(self, *exc):
            for p in self.params:
                p.data = torch.empty(0)

    fake = types.ModuleType("deepspeed")
    fake.zero = SimpleNamespace(GatheredParameters=GatheredParameters)
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    for name, p in model.named_parameters():
        p.ds_id, p.ds_name, p.ds_full, p.ds_numel = id(p), name, p.detach().clone(), p.numel()
        p.data = torch.empty(0)  # the local partition of a one-process world is empty here
    assert sharding_kind(model) == "deepspeed"
    limit = 16 * 4  # 0.weight (48 B) + 0.bias (12 B) fit; 1.weight (24 B) starts the next bucket
    for bucket in iter_buckets(model, limit):
        for name, tensor in bucket:
            assert torch.equal(tensor, reference[name])  # full while the bucket is alive
    assert gathered == [["0.weight", "0.bias"], ["1.weight", "1.bias"]]
    assert all(p.numel() == 0 for p in model.parameters())  # released again


# -- version tracking ---------------------------------------------------------------------------------
def test_weight_sync_skips_unchanged_versions_and_counts_bytes(tiny_echo):
    model, _ = tiny_echo
    sync = WeightSync(bucket_bytes=2048)
    seen = []
    stats = sync.sync(model, 0, lambda buckets: seen.extend(n for b in buckets for n, _ in b))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stats["bytes"] == total and stats["tensors"] == len(seen) == len(list(model.parameters()))
    assert stats["seconds"] >= 0 and stats["buckets"] >= 2
    assert sync.sync(model, 0, lambda b: pytest.fail("unchanged version must not sync")) is None
    sync.invalidate()  # e.g. the engine discarded its weights
    assert sync.sync(model, 0, lambda b: list(b)) is not None and sync.version == 0


def test_weight_sync_fails_when_the_engine_stops_reading(tiny_echo):
    model, _ = tiny_echo
    sync = WeightSync(bucket_bytes=1024)
    with pytest.raises(RuntimeError, match="partial update"):
        sync.sync(model, 3, lambda buckets: next(buckets))
    assert sync.version == -1  # the failed sync is not recorded


# -- vLLM outputs -> Generation ---------------------------------------------------------------------
def completion(index, ids, lps, reason):
    positions = [{t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(ids, lps)]
    return SimpleNamespace(index=index, token_ids=ids, logprobs=positions, finish_reason=reason, text="")


def request(rid, completions):
    return SimpleNamespace(request_id=str(rid), outputs=completions, finished=True)


EOS, PAD = 1, 0


def test_outputs_to_generation_shapes_lengths_truncation_and_logprobs():
    outputs = [
        request(0, [completion(1, [5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], "length"),  # out of order
                    completion(0, [5, EOS], [-0.5, -0.6], "stop")]),
        request(1, [completion(0, [9], [-1.5], "length"), completion(1, [EOS], [-0.7], "stop")]),
    ]
    gen = outputs_to_generation(outputs, n=2, pad_token_id=PAD)
    assert gen.completion_ids.shape == (4, 4) and gen.logprobs.shape == (4, 4)
    assert gen.lengths.tolist() == [2, 4, 1, 1]
    assert gen.truncated.tolist() == [False, True, True, False]
    assert gen.completion_ids[0].tolist() == [5, EOS, PAD, PAD]  # EOS is part of the response
    assert gen.completion_ids[1].tolist() == [5, 6, 7, 8]
    torch.testing.assert_close(gen.logprobs[0], torch.tensor([-0.5, -0.6, 0.0, 0.0]))
    torch.testing.assert_close(gen.logprobs[1], torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    assert (gen.logprobs[~gen.mask] == 0).all() and gen.logprobs.dtype == torch.float32


def test_outputs_to_generation_rejects_aborts_missing_logprobs_and_wrong_n():
    with pytest.raises(RuntimeError, match="abort"):
        outputs_to_generation([request(0, [completion(0, [3], [-1.0], "abort")])], 1, PAD)
    no_lps = completion(0, [3], [-1.0], "stop")
    no_lps.logprobs = None
    with pytest.raises(ValueError, match="logprobs=0"):
        outputs_to_generation([request(0, [no_lps])], 1, PAD)
    with pytest.raises(ValueError, match="expected 2"):
        outputs_to_generation([request(0, [completion(0, [3], [-1.0], "stop")])], 2, PAD)


# -- the engine's small pure functions ----------------------------------------------------------------
def test_logprobs_mode_matches_the_trainer_where_it_can():
    assert choose_logprobs_mode(0.7, 0, 1.0) == ("processed_logprobs", None)  # log_softmax(logits / T)
    assert choose_logprobs_mode(1.0, 50, 0.9) == ("raw_logprobs", None)  # log_softmax(logits) = T=1
    mode, gap = choose_logprobs_mode(0.7, 50, 1.0)
    assert mode == "processed_logprobs" and "renormalized" in gap


def test_sampling_kwargs_and_seeds():
    kw = sampling_kwargs(SamplingParams(12, temperature=0.8, top_p=0.9, top_k=5), 4, [1, 7], seed=11)
    assert kw == dict(n=4, temperature=0.8, top_p=0.9, top_k=5, max_tokens=12, logprobs=0,
                      stop_token_ids=[1, 7], seed=11, detokenize=False)
    seeds = request_seeds(100, 3, 4)
    assert seeds == [100, 104, 108]  # vLLM seeds sample j of a prompt with seed + j: all distinct
    assert all(0 <= s < 2**62 for s in request_seeds(2**63 - 2, 5, 8))


def test_slice_generation_and_tensor_parallel_groups():
    gen = Generation(torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]]), torch.full((3, 3), -1.0),
                     torch.tensor([3, 1, 2]), torch.tensor([True, False, False]))
    part = slice_generation(gen, 1, 3)
    assert part.completion_ids.tolist() == [[4, 0], [5, 6]] and part.lengths.tolist() == [1, 2]
    assert tensor_parallel_groups(4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="divide"):
        tensor_parallel_groups(3, 2)


def test_max_model_len_from_the_data_module():
    module = SimpleNamespace(hparams=SimpleNamespace(response_length=64), _trainer=None)
    assert infer_max_model_len(module) is None
    datamodule = SimpleNamespace(hparams={"prompt_length": 100})
    module._trainer = SimpleNamespace(datamodule=datamodule)
    assert infer_max_model_len(module) == 164


def test_launcher_env_keeps_an_existing_rendezvous():
    env = launcher_env(3, 1, 4, environ={"MASTER_ADDR": "node0", "MASTER_PORT": "1234"})
    assert env == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert int(launcher_env(0, 0, 1, environ={})["MASTER_PORT"]) > 0


# -- the engine against a fake vLLM ---------------------------------------------------------------------
class FakeLLM:
    """Records what the engine asks of vLLM 0.32's ``LLM`` (the same method names)."""

    def __init__(self):
        self.llm_engine = SimpleNamespace(model_executor=object())  # in-process engine core
        self.calls, self.loaded = [], {}
        self.model = SimpleNamespace(load_weights=self._load_weights)

    def _load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()

    def apply_model(self, fn):
        self.calls.append("apply_model")
        return [fn(self.model)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        assert method == "reload_weights" and kwargs["is_checkpoint_format"]
        self._load_weights(kwargs["weights_iterator"])
        return [None]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True

    def sleep(self, level=1):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))
        return True

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append("generate")
        self.requests = (prompts, sampling_params)
        outputs = []
        for rid, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            completions = []
            for j in range(sp.n):
                ids = [prompt["prompt_token_ids"][0] + j] * (1 + j) + ([EOS] if j % 2 == 0 else [])
                reason = "stop" if j % 2 == 0 else "length"
                completions.append(completion(j, ids, [-0.25] * len(ids), reason))
            outputs.append(request(rid, completions))
        return outputs


def make_fake_engine(**kwargs):
    llm = FakeLLM()
    return VLLMEngine(llm, [EOS], PAD, sampling_params_cls=SimpleNamespace, **kwargs), llm


@pytest.mark.parametrize("load_mode", ["direct", "reload"])
def test_update_weights_loads_every_parameter_once_under_hf_names(tiny_echo, load_mode):
    model, _ = tiny_echo
    engine, llm = make_fake_engine(weight_sync_bucket_mb=0.002, load_mode=load_mode)
    assert isinstance(engine, RolloutEngine) and engine.weights_version == -1
    stats = engine.update_weights(model, 0)
    params = dict(model.named_parameters())
    assert list(llm.loaded) == list(params)
    for name, tensor in llm.loaded.items():
        assert tensor.shape == params[name].shape and torch.equal(tensor, params[name])
    assert stats["bytes"] == sum(p.numel() * p.element_size() for p in params.values())
    if load_mode == "direct":
        assert llm.calls.count("apply_model") == stats["buckets"] > 1
    else:
        assert llm.calls.count("reload_weights") == 1
    assert llm.calls[-1] == "reset_prefix_cache" and engine.weights_version == 0
    assert engine.update_weights(model, 0) is None and llm.calls[-1] == "reset_prefix_cache"


def test_a_sync_holds_one_gathered_bucket_at_a_time():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    alive = []  # weak references to every gathered tensor

    def gather(param):
        assert all(ref() is None for ref in alive), "an earlier bucket is still alive during a gather"
        full = param.detach().clone()
        alive.append(weakref.ref(full))
        return full

    for param in model.parameters():
        param.full_tensor = partial(gather, param)
    engine, llm = make_fake_engine(weight_sync_bucket_mb=1 / 2**20)  # 1 byte: one tensor per bucket
    assert engine.update_weights(model, 0)["buckets"] == 6 and len(llm.loaded) == 6


def test_sleep_mode_wakes_weights_for_a_sync_and_level_2_forces_a_resync(tiny_echo):
    model, _ = tiny_echo
    engine, llm = make_fake_engine(sleep_level=2)
    assert llm.calls == ["sleep2"]  # the KV cache is freed until the first rollout
    engine.update_weights(model, 0)
    assert llm.calls[1] == ("wake_up", ("weights",)) and "reset_prefix_cache" not in llm.calls
    engine.wake()
    assert llm.calls[-1] == ("wake_up", ("kv_cache",))
    engine.sleep()
    llm.calls.clear()
    assert engine.update_weights(model, 0) is not None  # level 2 discarded the weights
    engine.wake()
    engine.sleep()
    llm.calls.clear()

    engine1, llm1 = make_fake_engine(sleep_level=1)
    engine1.update_weights(model, 0)
    engine1.wake()
    engine1.sleep()
    assert engine1.update_weights(model, 0) is None  # level 1 keeps weights (offloaded to CPU)
    engine1.wake()
    assert llm1.calls[-1] == ("wake_up", ("kv_cache", "weights"))


def test_generate_sends_token_prompts_and_per_prompt_seeds():
    engine, llm = make_fake_engine()
    params = SamplingParams(max_new_tokens=5, temperature=0.9)
    gen = engine.generate([[10, 11], [20]], 3, params, seed=7)
    prompts, sampling = llm.requests
    assert prompts == [{"prompt_token_ids": [10, 11]}, {"prompt_token_ids": [20]}]
    assert [sp.seed for sp in sampling] == [7, 10] and all(sp.logprobs == 0 and sp.n == 3 for sp in sampling)
    assert gen.completion_ids.shape[0] == 6 and gen.lengths.tolist() == [2, 2, 4, 2, 2, 4]
    assert gen.truncated.tolist() == [False, True, False] * 2
    assert gen.completion_ids[0].tolist()[:2] == [10, EOS]
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], 1, params, seed=0)


def test_engine_refuses_a_multiprocess_vllm():
    llm = FakeLLM()
    llm.llm_engine = SimpleNamespace()  # no model_executor: the engine core is another process
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        VLLMEngine(llm, [EOS], PAD)


# -- missing vLLM / CUDA ------------------------------------------------------------------------------
def test_missing_vllm_and_cuda_are_both_explained(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # blocks the import
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError) as error:
        check_vllm_available()
    message = str(error.value)
    assert "engine=vllm cannot start" in message
    assert "no CUDA GPU" in message and "engine: hf" in message
    assert "pip install 'gspo-lightning[vllm]'" in message


def test_missing_vllm_on_a_cuda_machine(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match=r"vLLM is not installed; install it with: pip install 'gspo-lightning\[vllm\]'") as error:
        check_vllm_available()
    assert "CUDA" not in str(error.value).split("install it with")[0]


def test_vllm_without_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU") as error:
        check_vllm_available()
    assert "not installed" not in str(error.value)


def test_choosing_engine_vllm_fails_at_start_with_the_message(monkeypatch):
    from gspo_lightning.module import GSPOModule

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = GSPOModule(model_name_or_path="builtin:tiny-echo", engine="vllm", num_return_sequences_in_group=2)
    module.configure_model()
    with pytest.raises(RuntimeError, match="engine=vllm cannot start"):
        module._make_engine()


def test_importing_the_package_and_engine_modules_never_imports_vllm(monkeypatch):
    import importlib

    import gspo_lightning
    from gspo_lightning.rollout import weight_sync

    monkeypatch.setitem(sys.modules, "vllm", None)  # any `import vllm` now raises ImportError
    for module in (gspo_lightning, weight_sync, vllm_engine):
        importlib.reload(module)  # re-runs the module body: no import of vllm at import time
    assert vllm_engine.INSTALL_HINT.startswith("pip install")
