"""A row's images: read from what a dataset holds, checked, in RGB.

A row's image column holds one image or a list of them, each a file path (relative paths start
at the data file's folder), raw bytes of an encoded image, a PIL image, or a ``datasets`` Image
feature's ``{"bytes": ..., "path": ...}``. A missing file or bytes that do not decode raise a
``ValueError`` naming the image, which the data module reports as a bad row.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Optional, Union

from PIL import Image, UnidentifiedImageError


def load_images(value: Any, base_dir: Optional[Path] = None) -> list[Image.Image]:
    """Every image of a row's image column, decoded, in RGB (``[]`` for ``None``)."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [_load_one(item, index, base_dir) for index, item in enumerate(items)]


def _load_one(item: Any, index: int, base_dir: Optional[Path]) -> Image.Image:
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


def _decode(source: Union[io.BytesIO, Path], what: str) -> Image.Image:
    try:
        with Image.open(source) as image:
            image.load()  # decode now: a truncated file fails here, not in the middle of a rollout
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise ValueError(f"{what} is not a readable image ({type(err).__name__}: {err})") from None


__all__ = ["load_images"]
