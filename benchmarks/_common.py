"""What the benchmark scripts share: units, tables, the machine, memory probes, configs, models.

The scale, round and block benchmarks print figures in the same units (GB = 1e9 bytes) and
tables through the package's one markdown writer, record the machine they ran on, measure peak
RSS and drop files from the page cache the same way, build validated configs from a workflow
config file with overrides, and size diffusers transformers by meta builds. Linux only
(``/proc``).
"""

from __future__ import annotations

import gc
import os
import platform
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9
HEAD_DIM = 128  # Flux's attention head width
MAX_DOUBLE_BLOCKS = 19  # Flux.1-dev's; single blocks are twice as many, as in Flux
POLL_SECONDS = 0.02
SAVE_TARGET = (1.5, 1 * GB)  # a sharded save's host RAM: peak <= 1.5 x the shard + 1 GB

# ------------------------------------------------------------------------------------------
# Units and tables
# ------------------------------------------------------------------------------------------


def gb(value: float) -> str:
    """Bytes as GB (1e9) with two decimals."""
    return f"{value / GB:.2f}"


def mb(value: float) -> str:
    """Bytes as MB (1e6) with two decimals."""
    return f"{value / 1e6:.2f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (:func:`jagg_pipeline.io.tables.markdown_table`) of the cells as text.

    Without its final newline: the scripts ``print`` it.
    """
    from jagg_pipeline.io.tables import markdown_table

    cells = [[str(c) for c in row] for row in rows]
    return markdown_table([str(h) for h in headers], cells).removesuffix("\n")


# ------------------------------------------------------------------------------------------
# The machine and its memory
# ------------------------------------------------------------------------------------------


def _meminfo(name: str) -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def machine() -> dict[str, Any]:
    """What the measurements ran on."""
    import torch

    cpu = ""
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": _meminfo("MemTotal"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def _status(field_name: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field_name)


def _malloc_trim() -> None:
    import ctypes

    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss() -> int:
    """The resident set size of this process in bytes."""
    return _status("VmRSS")


@dataclass
class PeakRss:
    """RSS before an operation and its peak during it (a 20 ms poller and the kernel's HWM)."""

    before: int = 0
    polled: int = 0
    hwm: int = 0
    hwm_reset: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def peak(self) -> int:
        return max(self.polled, self.hwm if self.hwm_reset else 0)

    @property
    def delta(self) -> int:
        return self.peak - self.before

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self.polled = max(self.polled, rss())

    @contextmanager
    def watch(self) -> Iterator[PeakRss]:
        """Measure the enclosed block."""
        gc.collect()
        _malloc_trim()  # freed heap pages back to the kernel: RSS before = what is alive
        try:  # writing 5 resets VmHWM to the current RSS (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.before = self.polled = rss()
        poller = threading.Thread(target=self._poll, daemon=True)
        poller.start()
        try:
            yield self
        finally:
            self._stop.set()
            poller.join()
            self.polled = max(self.polled, rss())
            self.hwm = _status("VmHWM")

    def record(self) -> dict[str, int]:
        return {
            "rss_before": self.before,
            "rss_peak": self.peak,
            "rss_peak_polled": self.polled,
            "rss_hwm": self.hwm if self.hwm_reset else -1,
        }


def drop_page_cache(folder: Path) -> None:
    """Evict the (fsynced, clean) pages of ``folder``'s files so that a read goes to the disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------


def base_config_data(path: Path) -> dict[str, Any]:
    """The base experiment sections of a workflow config file (``config.yaml``, a preset)."""
    from jagg_pipeline.config.yaml_io import read_yaml
    from jagg_pipeline.workflow.sections import split

    return split(read_yaml(path))[0]


def config_with(base: dict[str, Any], overrides: Sequence[str]) -> Any:
    """A RunConfig of ``base`` with ``key=value`` overrides, validated."""
    from jagg_pipeline.config.run import from_mapping
    from jagg_pipeline.config.yaml_io import apply_overrides

    return from_mapping(apply_overrides(base, list(overrides)))


# ------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------

# The transformers' published configs (diffusers' classes; counts from meta builds).
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "Flux.1-dev": ("FluxTransformer2DModel", {"guidance_embeds": True}),
    "QwenImage": (
        "QwenImageTransformer2DModel",
        {
            "attention_head_dim": 128,
            "axes_dims_rope": (16, 56, 56),
            "in_channels": 64,
            "joint_attention_dim": 3584,
            "num_attention_heads": 24,
            "num_layers": 60,
            "out_channels": 16,
            "patch_size": 2,
        },
    ),
    "SD3.5-medium": (
        "SD3Transformer2DModel",
        {
            "attention_head_dim": 64,
            "caption_projection_dim": 1536,
            "dual_attention_layers": tuple(range(13)),
            "in_channels": 16,
            "joint_attention_dim": 4096,
            "num_attention_heads": 24,
            "num_layers": 24,
            "out_channels": 16,
            "patch_size": 2,
            "pooled_projection_dim": 2048,
            "pos_embed_max_size": 384,
            "qk_norm": "rms_norm",
            "sample_size": 128,
        },
    ),
}
FAMILY_MODELS = {"flux": "Flux.1-dev", "qwenimage": "QwenImage", "sd3": "SD3.5-medium"}


def count_parameters(cls_name: str, kwargs: dict[str, Any]) -> int:
    """Parameters of a diffusers model class built on the meta device (no memory, no init)."""
    import diffusers
    import torch

    with torch.device("meta"):
        model = getattr(diffusers, cls_name)(**kwargs)
    return sum(p.numel() for p in model.parameters())


def flux_kwargs(heads: int, blocks: int) -> dict[str, Any]:
    """FluxTransformer2DModel arguments: Flux.1-dev's, at ``heads`` x 128 and ``blocks`` depth."""
    return {
        "num_layers": blocks,
        "num_single_layers": 2 * blocks,
        "num_attention_heads": heads,
        "attention_head_dim": HEAD_DIM,
        "guidance_embeds": True,
    }


def choose_flux(target: float) -> dict[str, Any]:
    """The Flux shape (heads x 128 wide, n double + 2n single blocks) for ``target`` params.

    The shallowest within 2 % of ``target`` (fewer, larger tensors, as in the real model),
    else the nearest. The count is linear in the depth: two meta builds per width suffice.
    """
    candidates = []
    for heads in range(1, 25):
        one = count_parameters("FluxTransformer2DModel", flux_kwargs(heads, 1))
        two = count_parameters("FluxTransformer2DModel", flux_kwargs(heads, 2))
        for blocks in range(1, MAX_DOUBLE_BLOCKS + 1):
            error = abs(one + (blocks - 1) * (two - one) - target) / target
            candidates.append((error, blocks, heads))
    close = [c for c in candidates if c[0] <= 0.02]
    _, blocks, heads = min(close, key=lambda c: (c[1], c[0])) if close else min(candidates)
    kwargs = flux_kwargs(heads, blocks)
    return {"kwargs": kwargs, "parameters": count_parameters("FluxTransformer2DModel", kwargs)}
