"""bench_real's arms: which Python runs each, and an arm refused before any run when its
Python lacks its framework or vLLM (no model is loaded, nothing is timed here)."""

import stat
import sys

import pytest

from tests.helpers import load_script


@pytest.fixture(scope="module")
def real():
    return load_script("benchmarks/bench_real.py")


@pytest.fixture
def bare_python(tmp_path):
    """A Python that finds only the standard library (-I -S: no site-packages, no PYTHONPATH)."""
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_vllm_arm_refused_when_its_python_lacks_vllm(real, bare_python, capsys):
    with pytest.raises(SystemExit) as exit_info:
        real.main(["--arms", "gspo,gspo-vllm", "--vllm-python", bare_python, "--python", sys.executable])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"arm gspo-vllm runs in --vllm-python {bare_python}, which cannot import gspo_lightning, vllm" in err
    assert "pass --vllm-python with a vLLM environment's python" in err


def test_hf_arm_refused_when_its_python_lacks_trl(real, bare_python, capsys):
    with pytest.raises(SystemExit):
        real.main(["--arms", "trl", "--python", bare_python])
    err = capsys.readouterr().err
    assert f"arm trl runs in --python {bare_python}, which cannot import trl" in err and "'.[bench]'" in err


def test_unknown_arm_and_a_python_that_does_not_run(real, tmp_path, capsys):
    with pytest.raises(SystemExit):
        real.main(["--arms", "gspo,vllm"])
    assert "unknown arm(s) ['vllm']; choose from gspo, gspo-vllm, gspo-bf16-engine, trl, trl-vllm" in capsys.readouterr().err
    missing = str(tmp_path / "no-python")
    assert real.missing_modules(missing, ["json"]) == [f"(cannot run {missing}: No such file or directory)"]


def test_each_arm_gets_its_python(real):
    assert [real.arm_python(a, "/hf/python", "/vllm/python") for a in ("gspo", "gspo-vllm", "trl", "trl-vllm")] == \
        ["/hf/python", "/vllm/python", "/hf/python", "/vllm/python"]
    assert real.missing_modules(sys.executable, ["json", "surely_no_such_module_here"]) == ["surely_no_such_module_here"]


def test_table_has_a_ratio_per_trl_arm(real):
    def arm(step, gen):
        return {"step_s": step, "generate": gen, "weight_sync": 0.5, "train": 2.0, "other": 0.1, "peak_rss_mib": 3000.0}

    cell = {"limit_s": 2.0, "gspo": arm(4.0, 1.4), "gspo-vllm": arm(3.0, 0.4), "trl": arm(8.0, 5.0)}
    lines = real.arms_table(cell).splitlines()
    assert lines[0] == ("| arm | precision | engine | s/step | / trl | / gspo fp32 | generate / weight push / train / other s "
                        "| peak RSS MiB | / FLOP limit |")
    assert lines[2] == "| gspo | fp32 | HF | 4.000 | **0.50x** | 1.00x | 1.400 / 0.500 / 2.000 / 0.100 | 3000 | 2.0x |"
    assert lines[3].startswith("| gspo-vllm | fp32 | vLLM | 3.000 | **0.38x** | 0.75x |")
    assert lines[4].startswith("| trl | fp32 | HF | 8.000 | **1.00x** | 2.00x |")


def test_table_at_two_precisions_compares_each_arm_with_trl_at_its_own(real):
    """--precision fp32 --precision bf16: the arms' runs under arm@precision, each ratio against TRL at the
    same precision and against our fp32 HF arm."""
    def arm(step):
        return {"step_s": step, "generate": 1.0, "weight_sync": 0.0, "train": 1.0, "other": 0.0, "peak_rss_mib": 100.0}

    assert real.arm_key("gspo", "bf16", ["fp32", "bf16"]) == "gspo@bf16" and real.arm_key("gspo", "fp32", ["fp32"]) == "gspo"
    cell = {"limit_s": 1.0, "precisions": ["fp32", "bf16"], "gspo@fp32": arm(4.0), "trl@fp32": arm(8.0),
            "gspo@bf16": arm(3.0), "gspo-bf16-engine@bf16": arm(2.0), "trl@bf16": arm(5.0)}
    rows = real.arms_table(cell).splitlines()[2:]
    assert [r.split(" | ")[:6] for r in rows] == [
        ["| gspo", "fp32", "HF", "4.000", "**0.50x**", "1.00x"],
        ["| trl", "fp32", "HF", "8.000", "**1.00x**", "2.00x"],
        ["| gspo", "bf16", "HF", "3.000", "**0.60x**", "0.75x"],
        ["| gspo-bf16-engine", "bf16", "HF, bf16 copy", "2.000", "**0.40x**", "0.50x"],
        ["| trl", "bf16", "HF", "5.000", "**1.00x**", "1.25x"]]
