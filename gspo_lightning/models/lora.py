"""LoRA: train low-rank adapters on a frozen policy, with ``peft``.

The adapters are injected into the policy in place (``peft.inject_adapter_in_model``), so the
policy stays the transformers class it was (``model.model``, ``lm_head``, ``config``: every path
of the trainer works unchanged) and only ``lora_A`` / ``lora_B`` require grad. What LoRA changes
elsewhere, each in one place:

- the reference policy is the base: the policy with its adapters off (:func:`adapters_disabled`),
  no second copy of the model;
- engines receive the merged weights under the base model's names (:class:`MergedLoRAWeight`,
  used by ``rollout/weight_sync.py``): any engine that loads the base model loads them; or,
  for engines that serve adapters (vLLM, rollout servers), the adapters alone under PEFT's
  names (:func:`adapter_named_weights`, :func:`write_adapter_folder`);
- checkpoints hold the adapters, the optimizer and the run state, not the frozen base
  (:func:`frozen_state_keys`), which is rebuilt from ``model_name_or_path`` on resume;
- exports: the merged model (:func:`merged_state_dict`, loads with Auto classes) and the PEFT
  adapter folder (:func:`save_adapter`, loads with ``PeftModel.from_pretrained`` on the base).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from gspo_lightning.errors import ConfigError, MissingPackageError
from gspo_lightning.models.vision import vision_tower_pattern

ADAPTER = "default"  # peft's adapter name; one adapter per policy


@dataclass
class LoRA:
    """The ``lora`` config block.

    Args:
        rank: the adapters' rank ``r``.
        alpha: scaling numerator: the update is ``alpha / r * B @ A``.
        dropout: dropout on the adapters' input (0: off; the engines sample without it).
        target_modules: ``all-linear`` (every linear layer of the decoder, not the output head),
            or module names, e.g. ``[q_proj, k_proj, v_proj, o_proj]``.
        init_seed: seed of the adapters' initial values (``lora_A``), apart from the run's
            random state: every rank, strategy and resume starts from the same adapters.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Union[str, list[str]] = "all-linear"
    init_seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"lora.rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ConfigError(f"lora.alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ConfigError("lora.target_modules is empty: use all-linear or name the modules, e.g. [q_proj, v_proj]")

    def as_dict(self) -> dict:
        """The config as JSON-able fields (a rollout server's spec carries it)."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "target_modules": targets,
                "init_seed": self.init_seed}

    def serving_config(self) -> dict:
        """What an engine serving these adapters must agree on (rank, alpha, target modules)."""
        fields = self.as_dict()
        return {key: fields[key] for key in ("rank", "alpha", "target_modules")}

    def peft_config(self, base_model_name_or_path: Optional[str] = None, exclude_modules: Optional[str] = None):
        """PEFT's config; ``exclude_modules``: a regex of module names left without adapters (a
        vision-language model's vision tower: ``models.vision.vision_tower_pattern``)."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_modules, bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=base_model_name_or_path, exclude_modules=exclude_modules)


def attach_lora(policy: nn.Module, lora: LoRA) -> nn.Module:
    """Inject the adapters into ``policy`` in place and freeze everything else.

    Fresh adapters leave the model's outputs unchanged (``lora_B`` starts at zero)."""
    try:
        from peft import inject_adapter_in_model
    except ImportError as err:
        raise MissingPackageError("model.lora needs the peft package: pip install 'gspo-lightning[lora]'") from err
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora.init_seed)
            # adapters on the language model only: a vision tower stays as it is
            policy = inject_adapter_in_model(lora.peft_config(exclude_modules=vision_tower_pattern(policy)), policy,
                                             adapter_name=ADAPTER)
    except ValueError as err:  # peft: "Target modules ... not found in the base model"
        names = sorted({name.rsplit(".", 1)[-1] for name, m in policy.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"lora.target_modules={lora.target_modules!r} matches no layer of this model "
                         f"({err}); its linear layers are named {names}") from err
    for name, param in policy.named_parameters():
        param.requires_grad_(".lora_" in name)
    return policy


def lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters (without importing peft when it cannot)."""
    return any(".lora_A." in name for name, _ in model.named_parameters())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model: every adapter of ``model`` off inside the block (the reference policy)."""
    layers = lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def frozen_state_keys(module: nn.Module) -> set[str]:
    """Names of ``module``'s frozen parameters, tied ones under each of their names: the
    frozen reference and LoRA's base, which checkpoints leave out (rebuilt on load)."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


# -- merged weights: what engines and exports see --------------------------------------------
class MergedLoRAWeight:
    """A LoRA layer's weight as the base model has it: ``W + scaling * B @ A``, computed when
    read. Sized like ``W`` without computing it (weight buckets are planned before gathering)."""

    def __init__(self, base: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float):
        self.base, self.lora_a, self.lora_b, self.scaling = base, lora_a, lora_b, scaling

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    def numel(self) -> int:
        return self.base.numel()

    def element_size(self) -> int:
        return self.base.element_size()

    def materialize(self, full: Callable[[Tensor], Tensor]) -> Tensor:
        """The merged weight; ``full`` gathers a sharded parameter (the identity otherwise)."""
        base, a, b = (full(t).detach() for t in (self.base, self.lora_a, self.lora_b))
        delta = (b.float() @ a.float()) * self.scaling  # in float32, then the base's dtype
        return (base.float() + delta).to(base.dtype)


def merged_named_weights(model: nn.Module, rename: Callable[[str], str] = lambda n: n) -> list[tuple[str, object]]:
    """``(base_name, tensor or MergedLoRAWeight)`` for every weight of the base model, in the
    order of ``named_parameters`` (the same on every rank: sharded reads are collectives)."""
    layers = {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    out: list[tuple[str, object]] = []
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if ".base_layer." in name:
            module_name, leaf = name.split(".base_layer.")
            layer = layers[module_name]
            if leaf == "weight" and ADAPTER in layer.lora_A:
                param = MergedLoRAWeight(param, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight,
                                         float(layer.scaling[ADAPTER]))
            name = f"{module_name}.{leaf}"
        out.append((rename(name), param))
    return out


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The base model's state dict with the adapters merged in (a new tensor per LoRA layer)."""
    with torch.no_grad():
        return {name: value.materialize(lambda t: t) if isinstance(value, MergedLoRAWeight) else value.detach()
                for name, value in merged_named_weights(model)}


def base_model_copy(model: nn.Module, state: dict[str, Tensor]) -> nn.Module:
    """A plain model of ``model``'s class and config holding ``state`` (no LoRA layers): what
    ``save_pretrained`` writes as a standalone model. Built on the meta device, so the only
    memory it takes is ``state``'s."""
    with torch.device("meta"):
        plain = type(model)(model.config)
    plain.load_state_dict(state, strict=False, assign=True)
    plain.tie_weights()  # a tied head is one parameter: named once in ``state``
    missing = [name for name, p in plain.named_parameters(remove_duplicate=False) if p.is_meta]
    if missing:
        raise RuntimeError(f"the merged model lacks {missing[:5]}: this LoRA policy's names do not map to its base class")
    plain.generation_config = model.generation_config
    return plain


# -- adapters alone: what adapter-serving engines receive ------------------------------------
_ADAPTER_PART = f".{ADAPTER}."


def peft_name(param_name: str) -> str:
    """PEFT's file name of an adapter parameter: ``...q_proj.lora_A.default.weight`` ->
    ``...q_proj.lora_A.weight`` (the adapter's name dropped, as in ``get_peft_model_state_dict``)."""
    for part in (".lora_A", ".lora_B"):
        param_name = param_name.replace(f"{part}{_ADAPTER_PART}", f"{part}.")
    return param_name


def adapter_param_name(name: str) -> str:
    """The inverse of :func:`peft_name`: the parameter that holds a pushed adapter tensor."""
    if is_adapter_name(name):
        return name[: -len("weight")] + f"{ADAPTER}.weight"
    raise ConfigError(f"{name[:200]!r} is not a LoRA adapter tensor (names end in .lora_A.weight or .lora_B.weight)")


def is_adapter_name(name: str) -> bool:
    return name.endswith((".lora_A.weight", ".lora_B.weight")) and _ADAPTER_PART not in name


def adapter_named_weights(model: nn.Module, rename: Callable[[str], str] = lambda n: n) -> list[tuple[str, Tensor]]:
    """``(peft_name, parameter)`` of every ``lora_A`` / ``lora_B`` of ``model``, in the order of
    ``named_parameters`` (the same on every rank: sharded reads are collectives)."""
    return [(peft_name(rename(name)), p) for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name]


def base_named_weights(model: nn.Module, rename: Callable[[str], str] = lambda n: n) -> list[tuple[str, Tensor]]:
    """The frozen base model's weights under its own names (adapters left out, not merged):
    what an adapter-serving engine loads once, at start."""
    out = []
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        out.append((rename(name.replace(".base_layer.", ".")), param))
    return out


ADAPTER_FILE = "adapter_model.safetensors"


def write_adapter_folder(pairs, folder: Union[str, Path], lora: LoRA, base_model_name_or_path: Optional[str] = None) -> Path:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) from
    ``(peft_name, tensor)`` pairs, as ``save_adapter`` writes it: what vLLM's ``LoRARequest``
    and ``PeftModel.from_pretrained`` read."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in pairs:
        if not is_adapter_name(name):
            raise ConfigError(f"{name[:200]!r} is not a LoRA adapter tensor (names end in .lora_A.weight or .lora_B.weight)")
        state[f"base_model.model.{name}"] = tensor.detach().to("cpu").contiguous()
    if not state:
        raise ConfigError("no adapter tensors to write: an adapter push carries lora_A / lora_B tensors")
    save_file(state, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    # the modules named, not ``all-linear``: a reader that is not peft (vLLM) need not expand it
    targets = sorted({name.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for name in state})
    dataclasses.replace(lora, target_modules=targets).peft_config(base_model_name_or_path).save_pretrained(folder)
    return folder


def save_adapter(model: nn.Module, folder: Union[str, Path], base_model_name_or_path: str, lora: LoRA) -> Path:
    """The PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``), for
    ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)``."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # PeftModel wraps the model as ``base_model.model``: its adapter files name tensors from there
    state = {f"base_model.model.{k}": v.detach().contiguous()
             for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}
    save_file(state, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    lora.peft_config(base_model_name_or_path, exclude_modules=vision_tower_pattern(model)).save_pretrained(folder)
    return folder
