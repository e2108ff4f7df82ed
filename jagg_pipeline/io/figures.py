"""Pictures people would rather look at than read: image grids with captions, loss curves.

Grids use Pillow only; curves use matplotlib (headless backend), imported when drawn. Every
figure of the package is drawn on :func:`pyplot` and written by :func:`save_figure`. Torch and
matplotlib are imported when used: the torch-free reports import this module.
"""

from __future__ import annotations

import functools
import io
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jagg_pipeline.io.artifacts import atomic_write_bytes

if TYPE_CHECKING:
    import torch


@functools.cache
def pyplot() -> Any:
    """``matplotlib.pyplot`` on the headless Agg backend (jobs and CI have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _write_png(path: str | Path, render: Callable[[io.BytesIO], Any]) -> Path:
    """``render`` a PNG in memory, then write it atomically, its digest recorded.

    So the manifest of the folder it lands in never reads it back.
    """
    buffer = io.BytesIO()
    render(buffer)
    return atomic_write_bytes(path, buffer.getbuffer())


def save_png(image: Any, path: str | Path) -> Path:
    """Write a Pillow ``image`` to ``path`` as a PNG, atomically."""
    return _write_png(path, lambda buffer: image.save(buffer, format="PNG"))


def save_figure(figure: Any, path: str | Path, **options: Any) -> Path:
    """Write matplotlib ``figure`` to ``path`` as a PNG, atomically, and close it.

    ``options``: more keyword arguments of ``Figure.savefig`` (e.g. ``dpi``).
    """
    _write_png(path, lambda buffer: figure.savefig(buffer, format="png", **options))
    pyplot().close(figure)
    return Path(path)


def image_grid(
    images: torch.Tensor,
    captions: Sequence[str] | None = None,
    *,
    columns: int = 4,
    cell: int = 128,
    caption_lines: int = 3,
) -> object:
    """A PIL image: uint8 images [B, 3, H, W] in ``cell``-pixel tiles, each captioned below.

    Small images are enlarged without smoothing (their pixels stay visible), large ones
    reduced with Lanczos. Captions wrap to the tile width; a newline starts a new line, and a
    long first paragraph (the prompt) is cut before the lines after it (the scores) are.
    """
    import torch
    from PIL import Image, ImageDraw

    if images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(f"expected uint8 images [B, 3, H, W], got {images.dtype} {images.shape}")
    count, _, height, width = images.shape
    scale = cell / max(height, width)
    cell_w, cell_h = max(1, round(width * scale)), max(1, round(height * scale))
    resample = Image.Resampling.NEAREST if scale >= 1 else Image.Resampling.LANCZOS
    chars = max(8, cell_w // 6)  # the default bitmap font is about 6 px wide
    text_h = 12 * caption_lines if captions is not None else 0
    rows = -(-count // columns)
    grid = Image.new("RGB", (columns * (cell_w + 4), rows * (cell_h + text_h + 4)), "white")
    draw = ImageDraw.Draw(grid)
    for i in range(count):
        x = (i % columns) * (cell_w + 4) + 2
        y = (i // columns) * (cell_h + text_h + 4) + 2
        tile = Image.fromarray(images[i].permute(1, 2, 0).cpu().numpy())
        grid.paste(tile.resize((cell_w, cell_h), resample), (x, y))
        if captions is not None:
            text = "\n".join(_caption_lines(captions[i], chars, caption_lines))
            draw.multiline_text((x, y + cell_h + 1), text, fill="black", spacing=1)
    return grid


def _caption_lines(caption: str, width: int, limit: int) -> list[str]:
    """Wrapped lines of ``caption``; its first paragraph is shortened to keep the others."""
    parts = caption.split("\n")
    # Whole words only: a number split across lines reads as two numbers.
    first, *rest = [textwrap.wrap(p, width, break_long_words=False) or [""] for p in parts]
    tail = [line for part in rest for line in part]
    return (first[: max(1, limit - len(tail))] + tail)[:limit]


def save_image_grid(
    path: str | Path, images: torch.Tensor, captions: Sequence[str] | None = None, **options: int
) -> Path:
    """Write :func:`image_grid` as a PNG, atomically."""
    return save_png(image_grid(images, captions, **options), path)


def save_curves(
    path: str | Path,
    curves: Mapping[str, Sequence[float]],
    *,
    title: str = "",
    xlabel: str = "step",
    ylabel: str = "loss",
    smooth: int = 25,
    log_y: bool = True,
) -> Path:
    """Plot each curve (raw, faint, and a running mean over ``smooth`` points) to a PNG."""
    import torch

    figure, axes = pyplot().subplots(figsize=(6, 3.5), dpi=100)
    for name, values in curves.items():
        series = torch.tensor(list(values), dtype=torch.float64)
        (line,) = axes.plot(series.numpy(), alpha=0.25, linewidth=0.8)
        if len(series) >= smooth > 1:
            kernel = torch.ones(smooth, dtype=torch.float64) / smooth
            mean = torch.nn.functional.conv1d(series[None, None], kernel[None, None])[0, 0]
            axes.plot(
                range(smooth - 1, len(series)), mean.numpy(), color=line.get_color(), label=name
            )
        else:
            line.set_label(name)
    if log_y:
        axes.set_yscale("log")
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    return save_figure(figure, path)
