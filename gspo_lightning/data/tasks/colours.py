"""The colour task: a vision-language model names the colour of a square in a generated image.

Each row is a 56-pixel image (``builtin:tiny-vlm``'s size) of a grey background with one square of
random size and place in red, green, blue or yellow (each channel jittered), and the prompt
``colour``; the answer is the colour's word. The reward is 1 when the first word of the completion
is the colour, so a policy that guesses scores 0.25. Nothing is learned before RL: the model starts
from random weights, its vision tower frozen, and must learn to read the tower's random features.
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

from gspo_lightning.errors import ConfigError

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SIDE = 56
BACKGROUND = (128, 128, 128)
JITTER = 25


def draw_square(colour: str, rng: random.Random) -> Image.Image:
    """A grey image with one square of ``colour`` (a key of :data:`COLOURS`), size and place drawn from ``rng``."""
    red, green, blue = (min(255, max(0, c + rng.randint(-JITTER, JITTER))) for c in COLOURS[colour])
    size = rng.randint(18, 34)
    left, top = rng.randint(0, SIDE - size), rng.randint(0, SIDE - size)
    image = Image.new("RGB", (SIDE, SIDE), BACKGROUND)
    ImageDraw.Draw(image).rectangle([left, top, left + size - 1, top + size - 1], fill=(red, green, blue))
    return image


# rows drawn at most: the data module renders every image once when it reads the data (20,000
# images would take half a minute); a run of 40 steps of 16 prompts uses 640
MAX_ROWS = 2048


def make_rows(num_rows: int, seed: int) -> list[dict]:
    """Rows with a ``prompt``, one image in ``images`` and the ``target`` colour word
    (at most :data:`MAX_ROWS`)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(min(num_rows, MAX_ROWS)):
        colour = rng.choice(sorted(COLOURS))
        rows.append({"prompt": "colour", "images": [draw_square(colour, rng)], "target": colour})
    return rows


def colour_reward(prompts: list, completions: list[str], target: list[str], **columns) -> list[float]:
    """1.0 where the completion's first word is the target colour, else 0.0."""
    if len(completions) != len(target):
        raise ConfigError(f"colour_reward got {len(completions)} completions but {len(target)} targets")
    return [float(bool(c.split()) and c.split()[0] == t) for c, t in zip(completions, target)]


# -- the same task as episodes: the environment shows the image when the model has taken a turn ------
def make_episode_rows(num_rows: int, seed: int) -> list[dict]:
    """Rows of :class:`~gspo_lightning.episodes.ShowImageEnvironment`: the picture is in ``picture``
    (the environment's to show), not in ``images`` (the data module's, which single-turn prompts
    start with)."""
    return [{"prompt": row["prompt"], "picture": row["images"][0], "target": row["target"]}
            for row in make_rows(num_rows, seed)]
