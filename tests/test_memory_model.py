"""benchmarks/memory_model.py: parameter counts against meta-device models, the activation
count against autograd's saved tensors, the tensor-byte meter, and one measured CPU step."""

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace

import pytest
import torch

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import _memory_child as child  # noqa: E402
import memory_model as mm  # noqa: E402


@pytest.mark.parametrize("key", ["qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"])
def test_closed_form_parameter_count_equals_the_meta_model(key):
    shape = mm.QWEN3[key]
    meta = sum(torch.Size(s).numel() for s in mm.meta_param_shapes(shape))
    assert mm.param_counts(shape)["total"] == meta


def test_parameter_counts_by_hand():
    # Qwen3-0.6B: per layer q 1024x2048, k and v 1024x1024, o 2048x1024, MLP 3 x 1024x3072,
    # two norms of 1024, q/k norms of 128: 15,730,944; embeddings 151936 x 1024, tied
    assert mm.param_counts(mm.QWEN3["qwen3-0.6b"])["total"] == 28 * 15_730_944 + 155_582_464 + 1024 == 596_049_920
    # Qwen3-8B: 36 layers of 192,946,432; untied head, so the 151936 x 4096 matrix counts twice
    counts = mm.param_counts(mm.QWEN3["qwen3-8b"])
    assert counts["head"] == counts["embed"] == 151936 * 4096
    assert counts["total"] == 8_190_735_360
    # the check's model too (untied, 4 layers)
    assert mm.param_counts(mm.CHECK_SHAPE)["total"] == sum(torch.Size(s).numel() for s in mm.meta_param_shapes(mm.CHECK_SHAPE))


def test_shards_round_each_parameter_up():
    assert mm.shard_numel([(5, 2), (4,)], 2) == 3 * 2 + 2


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_saved_bytes_match_autograd(dtype, grouped, monkeypatch):
    """The per-layer count against the tensors autograd actually saves in one Qwen3 layer, with
    transformers' default attention (key/value heads copied per query head: GPU runs) and with the
    grouped call that CPU runs take (models/cpu_attention.py)."""
    from transformers import Qwen3ForCausalLM

    from gspo_lightning.models.cpu_attention import SWITCH

    monkeypatch.setenv(SWITCH, "1" if grouped else "0")

    shape = mm.Shape("t", hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=300)
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(mm.qwen3_config(shape)).to(dtype).train()
    rows, length = 3, 40
    ids = torch.randint(0, shape.vocab, (rows, length))
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, :5] = 0  # left padding: the 4-D mask sdpa gets, as in training
    saved, inside, layer_inputs = {}, [False], {}
    layer = model.model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):  # the tensors saved while the layer runs, parameters aside
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def enter(module, args, kwargs):
        inside[0] = True
        layer_inputs.update(kwargs)

    layer.register_forward_pre_hook(enter, with_kwargs=True)
    layer.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, attention_mask=mask, use_cache=False)
    # the mask and the rotary cos/sin are built once and shared by every layer
    shared = {layer_inputs["attention_mask"].untyped_storage().data_ptr()}
    shared |= {t.untyped_storage().data_ptr() for t in layer_inputs["position_embeddings"]}
    measured = sum(v for k, v in saved.items() if k not in shared)
    b = 4 if dtype == torch.float32 else 2
    predicted = mm.layer_saved_bytes(shape, b, rows * length, rows * length, rows * length * length, grouped=grouped)
    assert predicted == pytest.approx(measured, rel=0.01)


def test_kv_cache_by_hand():
    # Qwen3-8B, 64 rows x (512 + 2048 - 1) positions x 36 layers x 8 kv heads x 128 x (k, v) x bf16
    pred = mm.predict(mm.QWEN3["qwen3-8b"], mm.Run(ranks=8, strategy="ddp", generation_batch_size=64))
    assert pred.phases["generate"]["KV cache"] == 24_149_753_856


def test_pending_fixes_are_flags_and_lower_fsdp2_memory():
    shape = mm.QWEN3["qwen3-1.7b"]
    after = mm.Run(ranks=8, strategy="fsdp2", response_length=4096, micro_batch_size=4)
    today = replace(after, fsdp2_chunked_head=False, fsdp2_sharded_reference=False)
    a, t = mm.predict(shape, after), mm.predict(shape, today)
    assert t.states["reference"] == 8 * a.states["reference"] == 2 * mm.param_counts(shape)["total"]
    assert t.peak > a.peak
    assert "today" in mm.behaviour(today) and "after fix" in mm.behaviour(after)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="strategy must be one of"):
        mm.predict(mm.CHECK_SHAPE, mm.Run(strategy="fsdp1"))
    with pytest.raises(ValueError, match="must divide by ranks=3"):
        mm.predict(mm.CHECK_SHAPE, mm.Run(ranks=3))


def test_live_tensor_bytes_counts_saved_and_freed_storages():
    meter = child.LiveTensorBytes()
    with meter:
        w = torch.randn(1000, 250, requires_grad=True)  # 1 MB
        y = (w * 2).sin()  # w * 2 is saved for sin's backward: alive without a Python name
        assert meter.live == 3_000_000
        y.sum().backward()  # frees the saved tensor, allocates w.grad
        assert 3_000_000 <= meter.live <= 3_000_016  # w, y, w.grad (and 0-d scalars)
        del y
        w.grad.untyped_storage().resize_(0)  # FSDP2 frees unsharded parameters this way
        assert 1_000_000 <= meter.live <= 1_000_016
    assert meter.peak >= 4_000_000  # w, w * 2, y and sin's gradient during backward


@pytest.mark.slow
def test_prediction_within_tolerance_of_a_measured_cpu_step(tmp_path):
    """One process, 2 steps of a 2-layer Qwen3 with the HF engine: the steady-state peak
    (step 2) measured as live tensor bytes against the prediction."""
    shape = mm.Shape("test", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=4000,
                     tied=False)
    run = replace(mm.CHECK_RUN, prompt_length=24, response_length=48, micro_batch_size=4)
    model_dir = mm.build_check_model(tmp_path / "model", shape, seed=7)
    out = tmp_path / "measured.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "_memory_child.py"), "--config", json.dumps(asdict(run)),
           "--model_dir", str(model_dir), "--out", str(out), "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(out.read_text())
    assert measured["response_widths"][-1] == run.response_length
    predicted = mm.predict(shape, run, mm.meta_param_shapes(shape))
    assert predicted.peak == pytest.approx(measured["peak"], rel=0.10)
