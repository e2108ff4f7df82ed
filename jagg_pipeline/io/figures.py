"""Pictures people would rather look at than read: image grids with captions, loss curves.

Grids use Pillow only; curves use matplotlib (headless backend), imported when drawn. Every
figure of the package is drawn on :func:`pyplot` and written by :func:`save_figure`; the
reports lay out their panels with :func:`panel_grid` (wrapped, never an empty panel), tick
round axes with :func:`round_ticks`, give each variant one colour (:func:`variant_colours`)
and write what a figure cannot show as text under it (:func:`footnote`, :func:`note_figure`).
Torch and matplotlib are imported when used: the torch-free reports import this module.
"""

from __future__ import annotations

import functools
import io
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
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


def panel_grid(
    count: int, *, columns: int = 3, size: tuple[float, float] = (4.5, 3.6)
) -> tuple[Any, list[Any]]:
    """A figure of ``count`` panels of ``size`` inches, at most ``columns`` to a row; its axes.

    Rows are filled evenly (4 panels: 2 x 2, not 3 + 1) and the cells left over are removed,
    so that no panel is drawn empty; the axes come in reading order.
    """
    rows = max(1, -(-count // columns))
    across = max(1, -(-count // rows))
    figure, grid = pyplot().subplots(
        rows, across, figsize=(size[0] * across, size[1] * rows), dpi=100, squeeze=False
    )
    axes = [axis for row in grid for axis in row]
    for spare in axes[count:]:
        spare.remove()
    return figure, axes[:count]


def round_ticks(axis: Any, rounds: Iterable[int]) -> None:
    """Tick the x axis of ``axis`` at whole numbers only, over the span of ``rounds``.

    Half a round of margin either side: matplotlib's own range around a single round is
    +-0.05, where no whole number but that round fits and its ticks fall back to fractions.
    """
    from matplotlib.ticker import MaxNLocator

    found = sorted(set(rounds))
    if found:
        margin = max(0.5, 0.05 * (found[-1] - found[0]))
        axis.set_xlim(found[0] - margin, found[-1] + margin)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def variant_colours(names: Iterable[str]) -> dict[str, str]:
    """One matplotlib colour per name, in order, so a variant looks alike in every panel.

    Each axes cycles colours on its own: a variant missing from one panel would shift the
    colours of the others there.
    """
    return {name: f"C{index % 10}" for index, name in enumerate(dict.fromkeys(names))}


def footnote(figure: Any, notes: Sequence[str], fontsize: float = 8) -> float:
    """Write ``notes`` under the panels of ``figure``, growing it to fit; their share of it.

    Pass the share as the bottom of ``tight_layout``'s rect, ``(0, share, 1, 1)``, so that
    the panels keep clear of the notes. Nothing to write: 0 and the figure as it was.
    """
    if not notes:
        return 0.0
    width, height = figure.get_size_inches()
    chars = max(20, int(width * 72 / (0.55 * fontsize)))  # a character is about 0.55 em wide
    lines = [line for note in notes for line in textwrap.wrap(note, chars)]
    extra = (len(lines) + 1) * fontsize * 1.3 / 72
    figure.set_size_inches(width, height + extra)
    margin = 0.5 * fontsize / 72 / (height + extra)
    figure.text(0.01, margin, "\n".join(lines), fontsize=fontsize, va="bottom")
    return extra / (height + extra)


def note_figure(notes: Sequence[str], width: float = 8) -> Any:
    """A figure of ``notes`` alone: what a report draws where it has no data to plot.

    Its file still exists for the workflow rules that list it, and it says why it is bare.
    """
    figure = pyplot().figure(figsize=(width, 0.1), dpi=100)
    footnote(figure, notes, fontsize=10)
    return figure


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
