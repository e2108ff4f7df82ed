"""The toy world's data: one coloured shape on a coloured background, with its caption.

Every image is drawn from its attributes (shape, colour, position, background), so captions and
images are generated on the fly from a seed, without end. A fixed subset of attribute
combinations is held out for evaluation. The renderer is also the ground truth that the
attribute reward compares against (:func:`shape_mask`).

Imports torch only in the functions that draw: the captions (:func:`parse_caption`) are
what ``config check`` parses every prompt of a toy-scored prompt file with.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IMAGE_SIZE = 32
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (40, 60, 220),
    "yellow": (240, 220, 30),
    "purple": (150, 40, 190),
    "cyan": (30, 210, 220),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "gray": (128, 128, 128),
}
# Object centres (x, y) in pixels; radius 9 keeps shapes large enough to be learnable.
POSITIONS: dict[str, tuple[float, float]] = {
    "left": (9.5, 15.5),
    "right": (21.5, 15.5),
    "top": (15.5, 9.5),
    "bottom": (15.5, 21.5),
    "center": (15.5, 15.5),
}
RADIUS = 8.5
POSITION_PHRASES = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "center": "in the center",
}
# How far a drawn colour may stray from its palette entry (per channel, 0-255).
COLOUR_JITTER = 12


@dataclass(frozen=True)
class Attributes:
    """What a caption says and an image shows."""

    shape: str
    colour: str
    position: str
    background: str

    def caption(self) -> str:
        """'a red circle on the left, white background'."""
        return (
            f"a {self.colour} {self.shape} {POSITION_PHRASES[self.position]}, "
            f"{self.background} background"
        )


ALL_ATTRIBUTES: tuple[Attributes, ...] = tuple(
    Attributes(s, c, p, b)
    for s, c, p, b in itertools.product(SHAPES, COLOURS, POSITIONS, BACKGROUNDS)
)
_BY_CAPTION = {a.caption(): a for a in ALL_ATTRIBUTES}


def parse_caption(caption: str) -> Attributes:
    """The attributes a toy caption names; a clear error for anything else."""
    try:
        return _BY_CAPTION[caption.strip()]
    except KeyError:
        raise ValueError(
            f"{caption!r} is not a toy-world caption (expected e.g. "
            f"{ALL_ATTRIBUTES[0].caption()!r})"
        ) from None


def split(holdout_every: int = 7) -> tuple[list[Attributes], list[Attributes]]:
    """(train, held-out) attribute combinations: every ``holdout_every``-th one is held out.

    Fixed, not seeded, so every stage and run agrees on it. A stride coprime with 2, 3 and 5
    (the attribute counts' factors) spreads the held-out set over every shape, colour,
    position and background: 39 of 270 combinations with the default 7.
    """
    held = [a for i, a in enumerate(ALL_ATTRIBUTES) if i % holdout_every == holdout_every // 2]
    held_set = set(held)
    return [a for a in ALL_ATTRIBUTES if a not in held_set], held


def shape_mask(shape: str, position: str, size: int = IMAGE_SIZE) -> torch.Tensor:
    """Boolean [size, size] mask of ``shape`` at ``position`` (the renderer's own geometry)."""
    import torch

    cx, cy = POSITIONS[position]
    scale = size / IMAGE_SIZE
    cx, cy, r = cx * scale, cy * scale, RADIUS * scale
    ys, xs = torch.meshgrid(
        torch.arange(size, dtype=torch.float32) + 0.5,
        torch.arange(size, dtype=torch.float32) + 0.5,
        indexing="ij",
    )
    dx, dy = xs - (cx + 0.5 * scale), ys - (cy + 0.5 * scale)
    if shape == "circle":
        return dx**2 + dy**2 <= r**2
    if shape == "square":
        half = r * 0.85
        return (dx.abs() <= half) & (dy.abs() <= half)
    if shape == "triangle":
        # Upward triangle with its base at +r and apex at -r.
        inside_height = (dy >= -r) & (dy <= r)
        half_width = (dy + r) / (2 * r) * r
        return inside_height & (dx.abs() <= half_width)
    raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")


def render(attributes: Attributes, generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 [3, H, W] image of ``attributes``; colours jittered with ``generator`` if given."""
    import torch

    background = torch.tensor(BACKGROUNDS[attributes.background], dtype=torch.float32)
    colour = torch.tensor(COLOURS[attributes.colour], dtype=torch.float32)
    if generator is not None:
        jitter = torch.randint(-COLOUR_JITTER, COLOUR_JITTER + 1, (2, 3), generator=generator)
        background = background + jitter[0]
        colour = colour + jitter[1]
    mask = shape_mask(attributes.shape, attributes.position)
    image = torch.where(mask, colour[:, None, None], background[:, None, None])
    return image.clamp(0, 255).round().to(torch.uint8)


@dataclass
class Batch:
    """Images (uint8 [B, 3, H, W]), their captions and attributes."""

    images: torch.Tensor
    captions: list[str]
    attributes: list[Attributes]


def sample_batch(
    batch: int, generator: torch.Generator, pool: list[Attributes] | None = None
) -> Batch:
    """``batch`` random (image, caption) pairs from ``pool`` (default: the training split)."""
    import torch

    pool = split()[0] if pool is None else pool
    picks = torch.randint(0, len(pool), (batch,), generator=generator).tolist()
    attrs = [pool[i] for i in picks]
    images = torch.stack([render(a, generator) for a in attrs])
    return Batch(images, [a.caption() for a in attrs], attrs)
