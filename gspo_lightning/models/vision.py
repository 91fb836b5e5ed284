"""Vision-language models: their images rendered into prompts, and what their forward needs.

A prompt with images is token ids in which each image is a run of image tokens (one per merged
patch), plus the image processor's output for it: ``pixel_values`` (every patch of every image,
flattened) and ``image_grid_thw`` (each image's grid of patches). Qwen2-VL-style models place the
image tokens with M-RoPE: three position ids per token (time, height, width), text tokens
counting on after an image from its largest side. Generation and training must use the same
positions, so both compute them here, with the model's own ``get_rope_index``, from the same ids.

Why not ``AutoProcessor``: transformers' Qwen-VL processors also hold a video processor, which
needs torchvision even for images (and torchvision has no CPU build for every torch). Rendering
is the chat template, the image processor and one expansion, done here with the model's own
image token.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from gspo_lightning.errors import ConfigError

# -- images from what datasets and environments hold ------------------------------------------------
# One image or a list of them, each a file path (relative ones start at ``base_dir``), raw bytes of an
# encoded image, a PIL image, or a ``datasets`` Image feature's ``{"bytes": ..., "path": ...}``. A
# missing file or bytes that do not decode raise a ``ValueError`` naming the image (a bad row).
def load_images(value: Any, base_dir: Optional[Path] = None) -> list:
    """Every image of a row's image column, decoded, in RGB (``[]`` for ``None``)."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [_load_one(item, index, base_dir) for index, item in enumerate(items)]


def _load_one(item: Any, index: int, base_dir: Optional[Path]):
    from PIL import Image

    what = f"image {index + 1}"
    if isinstance(item, dict):  # a datasets Image feature: bytes when embedded, else a path
        item = item.get("bytes") or item.get("path")
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, (bytes, bytearray)):
        return _decode(io.BytesIO(item), f"{what} ({len(item)} bytes)")
    if isinstance(item, (str, Path)):
        path = Path(item).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise ValueError(f"{what}: no file {str(path)!r}")
        return _decode(path, f"{what} ({path})")
    raise ValueError(f"{what} is a {type(item).__name__}: give a path, bytes, a PIL image or {{'bytes': ...}}")


def _decode(source: Union[io.BytesIO, Path], what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(source) as image:
            image.load()  # decode now: a truncated file fails here, not in the middle of a rollout
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise ValueError(f"{what} is not a readable image ({type(err).__name__}: {err})") from None


# a prompt's images as the model takes them: {"pixel_values": (patches, D), "image_grid_thw": (images, 3)}
ImageInputs = dict[str, Tensor]
VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")


def is_vision_language(model: nn.Module) -> bool:
    """Whether ``model`` takes images (its config has a vision tower)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def vision_tower(model: nn.Module) -> Optional[nn.Module]:
    """The module that encodes images (Qwen-VL's ``visual``), or ``None``."""
    for module in model.modules():
        for name in VISION_TOWER_NAMES:
            tower = getattr(module, name, None)
            if isinstance(tower, nn.Module):
                return tower
    return None


def vision_tower_pattern(model: nn.Module) -> Optional[str]:
    """A regex of the vision tower's module names (PEFT's ``exclude_modules``), ``None`` for a text model."""
    tower = vision_tower(model)
    if tower is None:
        return None
    name = next(name for name, module in model.named_modules() if module is tower)
    return rf"{re.escape(name)}(\..*)?"


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop gradients into the vision tower; returns how many parameters were frozen."""
    tower = vision_tower(model)
    if tower is None:
        raise ConfigError(f"{type(model).__name__} has no vision tower ({', '.join(VISION_TOWER_NAMES)}) to freeze")
    frozen = 0
    for parameter in tower.parameters():
        parameter.requires_grad_(False)
        frozen += parameter.numel()
    return frozen


def share_vision_tower(source: nn.Module, target: nn.Module) -> None:
    """Make ``target`` (a copy of ``source``, the reference) use ``source``'s frozen vision tower
    instead of its own copy: one tower in memory."""
    tower = vision_tower(source)
    for module in target.modules():
        for name in VISION_TOWER_NAMES:
            if isinstance(getattr(module, name, None), nn.Module):
                setattr(module, name, tower)
                return
    raise ConfigError(f"{type(target).__name__} has no vision tower to share")


def load_image_processor(name_or_path: str, trust_remote_code: bool = False):
    """The image processor of a model: a builtin's, or the one saved in its folder."""
    from gspo_lightning.models.tiny import build_image_processor, get_spec, is_builtin

    if is_builtin(name_or_path):
        spec = get_spec(name_or_path)
        if not spec.vision:
            raise ConfigError(f"{name_or_path} is a text model: it takes no images (use builtin:tiny-vlm)")
        return build_image_processor(spec)
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{name_or_path} has no image processor (preprocessor_config.json): {err}") from None


class ImageRenderer:
    """Token ids and model inputs of prompts with images.

    Args:
        tokenizer: the model's tokenizer, whose vocabulary has the image token.
        image_processor: turns images into ``pixel_values`` and ``image_grid_thw``.
        image_token: the placeholder the chat template writes once per image.
    """

    def __init__(self, tokenizer, image_processor, image_token: str = "<|image_pad|>"):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ConfigError(f"the tokenizer has no image token {image_token!r}: is the model a vision-language one?")
        self.merge = int(getattr(image_processor, "merge_size", 1) or 1)

    def render(self, text: str, images: list) -> tuple[list[int], ImageInputs]:
        """``text`` (after the chat template, one image token per image) with each image token
        expanded to that image's merged patches, and the images' model inputs."""
        return self.expand(self.tokenizer(text, add_special_tokens=False)["input_ids"], images)

    def expand(self, ids: list[int], images: list) -> tuple[list[int], ImageInputs]:
        """``ids`` (one image token per image) with each image token expanded to that image's
        merged patches, and the images' model inputs."""
        placeholders = sum(1 for i in ids if i == self.image_token_id)
        if placeholders != len(images):
            raise ValueError(f"the prompt has {placeholders} image placeholder(s) for {len(images)} image(s)")
        inputs = self.image_processor(images=images, return_tensors="pt")
        tokens_per_image = (inputs["image_grid_thw"].prod(-1) // (self.merge * self.merge)).tolist()
        expanded, image = [], 0
        for token in ids:
            if token == self.image_token_id:
                expanded.extend([token] * tokens_per_image[image])
                image += 1
            else:
                expanded.append(token)
        return expanded, {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}


def message_images(messages: list[dict]) -> list:
    """The images in chat messages, in order: each ``{"type": "image", "image": ...}`` part of a
    message's content (a PIL image, bytes, a path), decoded (``load_images``)."""
    found = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            found += [part.get("image") for part in content if isinstance(part, dict) and part.get("type") == "image"]
    if any(image is None for image in found):
        raise ValueError("an image part of a message has no image: write {'type': 'image', 'image': <PIL image, bytes or "
                         "path>}")
    return load_images(found)


def merge_image_inputs(entries: list[ImageInputs]) -> Optional[ImageInputs]:
    """The image inputs of a sequence made of several pieces (a prompt, environment replies), in order."""
    if not entries:
        return None
    if len(entries) == 1:
        return entries[0]
    return {"pixel_values": torch.cat([e["pixel_values"] for e in entries]),
            "image_grid_thw": torch.cat([e["image_grid_thw"] for e in entries])}


def _rope_index_owner(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if hasattr(module, "get_rope_index") and callable(module.get_rope_index):
            return module
    raise ConfigError(f"{type(model).__name__} has no get_rope_index: only Qwen-VL-style (M-RoPE) models take images")


def _image_features(model: nn.Module, entries: list[ImageInputs]) -> list[Tensor]:
    """Each entry's image embeddings ``(tokens, hidden)``, one vision-tower pass over them all;
    without gradients when the tower is frozen."""
    tower = vision_tower(model)
    device = next(model.parameters()).device
    pixel_values = torch.cat([entry["pixel_values"] for entry in entries]).to(device)
    grid = torch.cat([entry["image_grid_thw"] for entry in entries]).to(device)
    trains_tower = tower is not None and any(p.requires_grad for p in tower.parameters())
    with contextlib.nullcontext() if trains_tower else torch.no_grad():
        out = model.get_image_features(pixel_values, grid)
        # an output with the per-image embeddings in pooler_output (transformers >= 5.2x), or them alone
        per_image = out.pooler_output if hasattr(out, "pooler_output") else out
    features, first = [], 0
    for entry in entries:
        count = entry["image_grid_thw"].shape[0]
        features.append(torch.cat(per_image[first:first + count]))
        first += count
    return features


# the logit of a token a vision-language policy never samples: finite, so that its probability is
# exactly 0 and p * log p is 0 (an infinite one would make the entropy NaN)
NEVER_SAMPLED_LOGIT = -1e30


def placeholder_token_ids(model: nn.Module) -> list[int]:
    """The tokens that stand for an image's (or a video's) patches in a vision-language model's
    input. The policy never samples them: a sampled one could not be told from an image's, so
    engines and trainer alike give them probability 0 (:func:`never_sample_placeholders`)."""
    config = model.config
    return [int(t) for t in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
            if t is not None and t < model.get_output_embeddings().out_features]


def never_sample_placeholders(logits: Tensor, placeholders: list[int]) -> Tensor:
    """``logits`` with the placeholder tokens at :data:`NEVER_SAMPLED_LOGIT` (out of place, so
    gradients flow to the other logits)."""
    if not placeholders:
        return logits
    index = torch.tensor(placeholders, device=logits.device)
    return logits.index_fill(-1, index, NEVER_SAMPLED_LOGIT)


def vision_forward_inputs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                          images: list[Optional[ImageInputs]]) -> dict[str, Any]:
    """The inputs of a vision-language forward over ``input_ids`` (rows left- and right-padded):
    ``inputs_embeds`` with each row's image embeddings in place of its image tokens, in order,
    and the M-RoPE ``position_ids`` ``(3, rows, length)``. ``images[i]``: row ``i``'s images
    (``None``: none), those of its prompt and of its episode's environment turns. Rows that share
    an entry (a group's) share one pass of the vision tower."""
    if len(images) != input_ids.shape[0]:
        raise ValueError(f"{len(images)} image entries for {input_ids.shape[0]} rows")
    image_mask = input_ids == model.config.image_token_id
    distinct: dict[int, ImageInputs] = {}
    for entry in images:
        if entry is not None and entry["image_grid_thw"].numel():
            distinct.setdefault(id(entry), entry)
    embeds = model.get_input_embeddings()(input_ids)
    grid = None
    if distinct:
        features = dict(zip(distinct, _image_features(model, list(distinct.values()))))
        rows = [features[id(entry)] for entry in images if entry is not None and id(entry) in features]
        flat = torch.cat(rows).to(embeds.dtype)
        if flat.shape[0] != int(image_mask.sum()):
            raise ValueError(f"the prompts hold {int(image_mask.sum())} image tokens for {flat.shape[0]} image embeddings: "
                             "render prompts with models.vision.ImageRenderer")
        embeds = embeds.masked_scatter(image_mask[..., None].expand_as(embeds), flat)
        grid = torch.cat([entry["image_grid_thw"] for entry in images
                          if entry is not None and id(entry) in features]).to(input_ids.device)
    elif image_mask.any():
        raise ValueError("the prompts hold image tokens but no images were given")
    owner = _rope_index_owner(model)
    kwargs = {"image_grid_thw": grid, "attention_mask": attention_mask}
    if "mm_token_type_ids" in inspect.signature(owner.get_rope_index).parameters:  # newer transformers take the image
        kwargs["mm_token_type_ids"] = image_mask.int()                               # tokens; older find them in the ids
    position_ids, _ = owner.get_rope_index(input_ids, **kwargs)
    return {"inputs_embeds": embeds, "position_ids": position_ids}


__all__ = ["NEVER_SAMPLED_LOGIT", "ImageInputs", "ImageRenderer", "load_images", "message_images", "merge_image_inputs", "never_sample_placeholders", "placeholder_token_ids", "freeze_vision_tower", "share_vision_tower", "vision_tower_pattern", "is_vision_language", "load_image_processor",
           "vision_forward_inputs", "vision_tower"]
