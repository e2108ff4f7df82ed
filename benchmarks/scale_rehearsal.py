"""Scale rehearsal: what a training checkpoint and a rollout cost in memory, time and disk.

Three parts, printed as tables and written as one JSON file (``--out``):

1. **Checkpoint rehearsal.** A Flux-architecture transformer (diffusers
   ``FluxTransformer2DModel``, random float32 weights, about ``--params`` parameters) is
   FSDP2-sharded (each block, then the root) on 2 gloo ranks, with AdamW state created by one
   step on random gradients. Two ways of checkpointing it, each save and each load in its own
   ``torchrun`` job so that every peak RSS belongs to one operation:

   - ``gathered`` (the code before sharded checkpoints): full model and optimizer state dicts
     gathered to rank 0's CPU (``full_state_dict``, ``cpu_offload``) and written there with
     safetensors; loaded back by rank 0 reading both files and broadcasting
     (``broadcast_from_rank0``);
   - ``sharded`` (now): :func:`jagg_pipeline.io.shards.save` of
     :func:`~jagg_pipeline.stages.distributed.model_state_dict` and
     :func:`~jagg_pipeline.stages.distributed.optimizer_state_dict` by every rank; loaded back into
     fresh sharded templates as the train stage resumes
     (:func:`jagg_pipeline.stages.policy.load_weights`,
     :func:`jagg_pipeline.io.shards.load`, ``distributed.load_*``).

   Per variant and rank: seconds (barrier to barrier), bytes on disk, the rank's shard (its
   local parameters + optimizer state), and the peak RSS during save and load, absolute and
   above the RSS just before (a thread polls ``VmRSS`` every 20 ms; the kernel's high-water
   mark ``VmHWM``, reset before each operation, catches what the poller misses). Every load is
   checked byte for byte: sha256 of each local weight and moment after the load equals the
   saved rank's. The target: the sharded save's peak RSS per rank <= 1.5 x its shard + 1 GB.
   Files are fsynced when written (as the checkpoint code does) and dropped from the page
   cache before loading (``posix_fadvise``), so loads read the disk.

2. **Rollout bytes per sample**, before (every trained step stored a velocity) and now
   (:func:`jagg_pipeline.stages.rollout.velocity_steps`, in
   :func:`~jagg_pipeline.stages.rollout.compute_dtype`), for the toy world's default config
   (measured
   on a real rollout of the toy SD3 pipeline with random weights, checked against the count
   from shapes), for Flux.1-dev at 1024 px (counted from its shapes: 28 steps, all SDE, 16
   trained, as DanceGRPO) and for the project's presets as written (``--presets``).

3. **Projection** to Flux.1-dev, QwenImage and SD3.5-medium, full fine-tuning with AdamW on 8
   ranks: checkpoint bytes per round, host RAM while saving (gathered vs sharded, scaled by the
   rehearsal's measured overheads), disk for 300 rounds (all kept vs ``workflow.keep_every``),
   rollout disk per round, the base model every rank loads, and the sha256 time of the stage
   manifests' input checks (throughput measured here on a 1 GiB file).

    python benchmarks/scale_rehearsal.py --params 5e8 --out results/bench/scale_rehearsal.json
    python benchmarks/scale_rehearsal.py --params 20e6  # smoke run: start-up of 4 jobs dominates

Linux only (``/proc/self/status``). Each rank runs one thread (2 ranks on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

GB = 1e9
RANKS = 2
HEAD_DIM = 128  # Flux's attention head width
MAX_DOUBLE_BLOCKS = 19  # Flux.1-dev's; single blocks are twice as many, as in Flux
VARIANTS = ("gathered", "sharded")
POLICY_FILE = "policy.safetensors"  # the gathered layout (the code before sharded checkpoints)
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_PREFIX = "state/"
TARGET_FACTOR, TARGET_EXTRA = 1.5, 1 * GB  # sharded save: peak RSS <= 1.5 x shard + 1 GB
POLL_SECONDS = 0.02

# ------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------


def flux_kwargs(heads: int, blocks: int) -> dict[str, Any]:
    """FluxTransformer2DModel arguments: Flux.1-dev's, at ``heads`` x 128 and ``blocks`` depth."""
    return {
        "num_layers": blocks,
        "num_single_layers": 2 * blocks,
        "num_attention_heads": heads,
        "attention_head_dim": HEAD_DIM,
        "guidance_embeds": True,
    }


def count_parameters(cls_name: str, kwargs: dict[str, Any]) -> int:
    """Parameters of a diffusers model class built on the meta device (no memory, no init)."""
    import diffusers
    import torch

    with torch.device("meta"):
        model = getattr(diffusers, cls_name)(**kwargs)
    return sum(p.numel() for p in model.parameters())


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


def build_sharded(kwargs: dict[str, Any], mesh: Any) -> nn.Module:
    """The transformer built on the meta device, FSDP2-sharded, materialised as local shards.

    Every block is its own FSDP unit, then the root (as ``distributed.shard_backbone``); only
    this rank's shards are ever allocated. Values are left unset: the caller fills them.
    """
    import torch
    from diffusers import FluxTransformer2DModel
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = FluxTransformer2DModel(**kwargs)
    for block in [*model.transformer_blocks, *model.single_transformer_blocks, model]:
        fully_shard(block, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from jagg_pipeline.io.shards import local_tensor

    return local_tensor(tensor)


def train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """Random weights (std 0.02), then one AdamW step on random gradients: real moments."""
    import torch
    from torch.distributed.tensor import DTensor

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            _local(param).normal_(0.0, 0.02, generator=generator)
            grad = torch.randn(_local(param).shape, generator=generator) * 1e-3
            param.grad = DTensor.from_local(
                grad, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def blank_template(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """NaN weights and the optimizer's state created (zero moments): a fresh load target."""
    import torch

    from jagg_pipeline.stages import distributed

    with torch.no_grad():
        for param in model.parameters():
            _local(param).fill_(float("nan"))
    distributed.optimizer_state_dict(model, optimizer)  # creates the state


def _named_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, Any]]:
    """(name, local tensor) of every weight and every optimizer-state tensor, in order."""
    import torch

    for name, param in model.named_parameters():
        yield name, _local(param.detach())
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                yield f"{name}/{key}", _local(value)


def shard_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The local bytes of this rank: weights, optimizer state and both."""
    weights = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    total = sum(t.numel() * t.element_size() for _, t in _named_state(model, optimizer))
    return {"weights": weights, "optimizer": total - weights, "shard": total}


def fingerprints(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of the bytes of each local weight and optimizer-state tensor."""
    import torch

    digests = {}
    for name, tensor in _named_state(model, optimizer):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        digests[name] = hashlib.sha256(data).hexdigest()
    return digests


# ------------------------------------------------------------------------------------------
# Peak RSS
# ------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------
# The two checkpoint variants (run in the workers)
# ------------------------------------------------------------------------------------------


def _fsync(paths: Sequence[Path]) -> None:
    for path in paths:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


class Laps:
    """Seconds between successive calls, by name: where an operation's time goes."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self._last
        self._last = now


def gathered_save(
    model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, lap: Laps
) -> None:
    """Full state dicts on rank 0's CPU, written there with safetensors (the former code)."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(
        model, options=dataclasses.replace(full, ignore_frozen_params=True)
    )
    state = get_optimizer_state_dict(model, optimizer, options=full)
    lap("gather")
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / POLICY_FILE))
        tensors, scalars = {}, {}
        for param, values in state["state"].items():
            for name, value in values.items():
                if hasattr(value, "contiguous"):
                    tensors[f"{STATE_PREFIX}{param}/{name}"] = value.contiguous()
                else:
                    scalars.setdefault(param, {})[name] = value
        meta = json.dumps({"param_groups": state["param_groups"], "scalars": scalars})
        save_file(tensors, str(folder / OPTIMIZER_FILE), metadata={"optimizer": meta})
        lap("write")
        _fsync([folder / POLICY_FILE, folder / OPTIMIZER_FILE])
        lap("fsync")


def gathered_load(
    model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, lap: Laps
) -> None:
    """Rank 0 reads both files and broadcasts; every rank keeps its shards (the former code)."""
    import torch.distributed as dist
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    weights: dict[str, Any] = {}
    state: dict[str, Any] = {}
    if dist.get_rank() == 0:
        weights = load_file(str(folder / POLICY_FILE))
        with safe_open(str(folder / OPTIMIZER_FILE), "pt") as handle:
            meta = json.loads(handle.metadata()["optimizer"])
            per_param: dict[str, dict[str, Any]] = {p: dict(v) for p, v in meta["scalars"].items()}
            for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                param, _, name = key.removeprefix(STATE_PREFIX).rpartition("/")
                per_param.setdefault(param, {})[name] = handle.get_tensor(key)
        state = {"state": per_param, "param_groups": meta["param_groups"]}
        lap("read")
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=broadcast)
    lap("broadcast weights")
    set_optimizer_state_dict(model, optimizer, state, options=broadcast)
    lap("broadcast optimizer")


def sharded_save(
    model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, lap: Laps
) -> None:
    """Every rank writes its shards (``checkpoint.write_checkpoint``'s tensor part)."""
    from jagg_pipeline.io import shards
    from jagg_pipeline.stages import distributed

    shards.save(distributed.model_state_dict(model), folder / "policy")
    lap("weights")
    shards.save(distributed.optimizer_state_dict(model, optimizer), folder / "optimizer")
    lap("optimizer")


def sharded_load(
    model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, lap: Laps
) -> None:
    """Every rank reads its shards back, as the train stage resumes from a checkpoint."""
    from jagg_pipeline.io import shards
    from jagg_pipeline.stages import distributed
    from jagg_pipeline.stages.policy import load_weights

    weights = distributed.model_state_dict(model)
    load_weights(weights, folder / "policy", collective=True)
    distributed.load_model_state_dict(model, weights)
    lap("weights")
    state = distributed.optimizer_state_dict(model, optimizer)
    shards.load(state, folder / "optimizer")
    distributed.load_optimizer_state_dict(model, optimizer, state)
    lap("optimizer")


OPERATIONS: dict[tuple[str, str], Callable[..., None]] = {
    ("gathered", "save"): gathered_save,
    ("gathered", "load"): gathered_load,
    ("sharded", "save"): sharded_save,
    ("sharded", "load"): sharded_load,
}


def worker(args: argparse.Namespace) -> None:
    """One rank of one operation (``--worker VARIANT-PHASE``), under torchrun."""
    import torch

    from jagg_pipeline.stages import distributed

    torch.set_num_threads(1)
    variant, phase = args.worker.split("-")
    folder = Path(args.dir)
    with distributed.distributed("cpu") as ctx:
        rss_imported = rss()
        model = build_sharded(json.loads(args.model), ctx.mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        if phase == "save":
            train_one_step(model, optimizer, seed=1000 + ctx.rank)
        else:
            blank_template(model, optimizer)
        sizes = shard_bytes(model, optimizer)
        peak = PeakRss()
        distributed.barrier()
        with peak.watch():
            start = time.perf_counter()
            lap = Laps()
            OPERATIONS[variant, phase](model, optimizer, folder, lap)
            distributed.barrier()
            lap("barrier")
            seconds = time.perf_counter() - start
        prints = fingerprints(model, optimizer)
        saved = folder.parent / f"{folder.name}.fingerprints-{ctx.rank}.json"
        record: dict[str, Any] = {
            "variant": variant,
            "phase": phase,
            "rank": ctx.rank,
            "seconds": seconds,
            "parts": lap.parts,
            "rss_imported": rss_imported,
            **sizes,
            **peak.record(),
        }
        if phase == "save":
            saved.write_text(json.dumps(prints))
        else:
            expected = json.loads(saved.read_text())
            differ = sorted(k for k in expected if prints.get(k) != expected[k])
            record["verified_tensors"] = len(expected)
            record["differing_tensors"] = differ[:10]
            record["exact"] = not differ and set(prints) == set(expected)
        Path(f"{args.result}.rank{ctx.rank}.json").write_text(json.dumps(record))


# ------------------------------------------------------------------------------------------
# The rehearsal (parent process)
# ------------------------------------------------------------------------------------------


def _drop_page_cache(folder: Path) -> None:
    """Evict the (fsynced, clean) pages of ``folder``'s files so that a load reads the disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_operation(variant: str, phase: str, model: dict[str, Any], folder: Path) -> list[dict]:
    """One torchrun job of ``RANKS`` gloo ranks; each rank's record."""
    result = folder.parent / f"{variant}-{phase}"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(RANKS),
        str(Path(__file__).resolve()),
        "--worker",
        f"{variant}-{phase}",
        "--model",
        json.dumps(model["kwargs"]),
        "--dir",
        str(folder),
        "--result",
        str(result),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, env=env)
    return [json.loads(Path(f"{result}.rank{r}.json").read_text()) for r in range(RANKS)]


def rehearse(model: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Save then load with each variant; the checkpoint is deleted after its load."""
    results: dict[str, Any] = {}
    for variant in VARIANTS:
        folder = workdir / variant
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        save = run_operation(variant, "save", model, folder)
        disk = _disk_bytes(folder)
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        _drop_page_cache(folder)
        load = run_operation(variant, "load", model, folder)
        shutil.rmtree(folder)
        results[variant] = {"disk_bytes": disk, "files": files, "save": save, "load": load}
    return results


def target_check(rehearsal: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank: sharded save's peak RSS against 1.5 x shard + 1 GB."""
    rows = []
    for record in rehearsal["sharded"]["save"]:
        limit = TARGET_FACTOR * record["shard"] + TARGET_EXTRA
        rows.append(
            {
                "rank": record["rank"],
                "peak": record["rss_peak"],
                "shard": record["shard"],
                "limit": limit,
                "pass": record["rss_peak"] <= limit,
            }
        )
    return rows


def overheads(rehearsal: dict[str, Any]) -> dict[str, float]:
    """Measured RSS growth while saving: gathered rank 0 per checkpoint byte, sharded per shard."""
    gathered = rehearsal["gathered"]["save"]
    total = sum(r["shard"] for r in gathered)
    rank0 = next(r for r in gathered if r["rank"] == 0)
    sharded = rehearsal["sharded"]["save"]
    return {
        "gathered_rank0_per_checkpoint_byte": (rank0["rss_peak"] - rank0["rss_before"]) / total,
        "sharded_per_shard_byte": max(
            (r["rss_peak"] - r["rss_before"]) / r["shard"] for r in sharded
        ),
        "sharded_load_per_shard_byte": max(
            (r["rss_peak"] - r["rss_before"]) / r["shard"] for r in rehearsal["sharded"]["load"]
        ),
        "imported_rss": max(r["rss_imported"] for v in VARIANTS for r in rehearsal[v]["save"]),
    }


# ------------------------------------------------------------------------------------------
# Rollout bytes per sample
# ------------------------------------------------------------------------------------------

ROLLOUT_SETTINGS: dict[str, list[str]] = {
    "exact": ["jagg.mode=exact"],
    "jagg W=4 f=1": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=1.0"],
    "jagg W=4 f=0.5": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=0.5"],
    "jagg W=2 f=1": ["jagg.mode=jagg", "jagg.window=2", "jagg.jagg_frac=1.0"],
    "no_interp drop W=4": ["jagg.mode=no_interp", "jagg.no_interp=drop", "jagg.window=4"],
    "no_interp nearest W=4": ["jagg.mode=no_interp", "jagg.no_interp=nearest", "jagg.window=4"],
    "jagg W=4 f=auto": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=auto"],
}
FLUX_DEV_ROLLOUT = [
    "backbone.family=flux",
    "backbone.path=black-forest-labs/FLUX.1-dev",
    "backbone.dtype=bfloat16",
    "backbone.height=1024",
    "backbone.width=1024",
    "backbone.max_sequence_length=512",
    "sampler.trajectory=full",
    "sampler.num_steps=28",
    "sampler.trained_fraction=0.5926",  # round(0.5926 x 27 eligible steps) = 16 trained
    "sampler.step=dance_grpo",
    "sampler.group_size=16",
    "sampler.prompts_per_round=64",
    "sampler.batch_size=16",
    "train.nproc=8",
    "train.rounds=300",
]
SAMPLES_PER_ROUND = 64 * 16  # the projection's DanceGRPO-like round: 64 prompts x 16 samples


@dataclass(frozen=True)
class SampleLayout:
    """What one rollout sample stores, by shape and dtype (the rollout stage's tensors)."""

    steps: int
    latent: tuple[int, ...]
    latent_dtype: str
    cond: dict[str, tuple[tuple[int, ...], str]]
    image: tuple[int, ...]  # uint8

    def bytes_without_velocities(self) -> int:
        """Latents (T + 1), float32 log-probs (T), 4 int64 ids, conditioning, image."""
        latents = (self.steps + 1) * math.prod(self.latent) * _itemsize(self.latent_dtype)
        log_probs = self.steps * (8 if self.latent_dtype == "float64" else 4)
        cond = sum(math.prod(s) * _itemsize(d) for s, d in self.cond.values())
        return latents + log_probs + 4 * 8 + cond + math.prod(self.image)

    def velocity_bytes(self, dtype: str) -> int:
        """One stored velocity (one latent) in ``dtype``."""
        return math.prod(self.latent) * _itemsize(dtype)


def _itemsize(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "uint8": 1}[dtype]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def base_config_data(path: Path) -> dict[str, Any]:
    """The base experiment sections of a workflow config file (``config.yaml``)."""
    from jagg_pipeline.config.tools import read_yaml
    from jagg_pipeline.workflow.sections import split

    return split(read_yaml(path))[0]


def config_with(base: dict[str, Any], overrides: Sequence[str]) -> Any:
    """An RunConfig of ``base`` with ``key=value`` overrides, validated."""
    from jagg_pipeline.config.run import from_mapping
    from jagg_pipeline.config.tools import apply_overrides

    return from_mapping(apply_overrides(base, list(overrides)))


def _velocity_row(config: Any, layout: SampleLayout, name: str) -> dict[str, Any]:
    """Before/now bytes per sample of one setting (velocity steps from the real functions)."""
    from jagg_pipeline.stages.rollout import compute_dtype, derive_seed, step_masks, velocity_steps

    masks = step_masks(config.sampler, derive_seed(config.train.seed, "steps", 0))
    trained = masks.trained_indices
    stored = velocity_steps(config, trained)
    dtype = _dtype_name(compute_dtype(config.backbone))
    rest = layout.bytes_without_velocities()
    return {
        "setting": name,
        "trained_steps": len(trained),
        "velocity_steps_now": len(stored),
        "velocity_dtype_now": dtype,
        "before_f32": rest + len(trained) * layout.velocity_bytes("float32"),
        # What the former code wrote: every trained step, as the network returned it, which
        # is the compute dtype too (bfloat16 for a bf16 or mixed-precision policy).
        "before_as_stored": rest + len(trained) * layout.velocity_bytes(dtype),
        "now": rest + len(stored) * layout.velocity_bytes(dtype),
    }


def toy_rollouts(config_file: Path, workdir: Path) -> dict[str, Any]:
    """The toy world's default config: real one-micro-batch rollouts per setting, on disk."""
    import torch
    from diffusers.utils import logging as diffusers_logging

    from jagg_pipeline.backbones import load_backbone
    from jagg_pipeline.bench.measure import save_bench_backbone
    from jagg_pipeline.io.prompts import resolve_prompts
    from jagg_pipeline.stages.rollout import plan_rollout, sample_batches

    torch.set_num_threads(1)
    diffusers_logging.disable_progress_bar()
    diffusers_logging.set_verbosity_error()
    base = base_config_data(config_file)
    pipeline = save_bench_backbone("toy-sd3", workdir / "toy-sd3")
    default = config_with(base, [f"backbone.path={pipeline}"])
    backbone = load_backbone(default.backbone)
    pool = resolve_prompts(default.sampler.prompts, default.sampler.prompt_column)
    rows = []
    layout = None
    for name, overrides in ROLLOUT_SETTINGS.items():
        config = config_with(base, [f"backbone.path={pipeline}", *overrides])
        plan = plan_rollout(config, pool, 0)
        batch = sample_batches(backbone, plan, plan.micro_batches[:1], desc=name, progress=False)
        if layout is None:
            layout = SampleLayout(
                steps=plan.num_steps,
                latent=tuple(batch.latents.shape[2:]),
                latent_dtype=_dtype_name(batch.latents.dtype),
                cond={k: (tuple(v.shape[1:]), _dtype_name(v.dtype)) for k, v in batch.cond.items()},
                image=tuple(batch.images.shape[1:]),
            )
        out = workdir / "toy-rollout" / name.replace(" ", "_")
        out.mkdir(parents=True)
        path = batch.save(out)
        row = _velocity_row(config, layout, name)
        row["file_bytes_per_sample"] = path.stat().st_size / len(batch)
        row["stored_velocity_steps"] = batch.velocity_steps or []
        assert len(row["stored_velocity_steps"]) == row["velocity_steps_now"], row
        rows.append(row)
    shutil.rmtree(workdir / "toy-rollout")
    shutil.rmtree(pipeline)
    assert layout is not None
    return {
        "config": str(config_file),
        "layout": dataclasses.asdict(layout),
        "samples_measured": len(batch),
        "rows": rows,
    }


QWEN_PROMPT_TOKENS = 128  # QwenImage pads text to the round's longest prompt: assumed


def layout_for(config: Any) -> SampleLayout:
    """The sample layout of a real checkpoint of ``config.backbone``'s family, from its shapes.

    All three VAEs have 16 latent channels at 1/8 of the image size; Flux and QwenImage pack
    2 x 2 latent cells into a token of 64 channels. Conditioning: Flux T5 [L, 4096] + CLIP
    pooled [768]; SD3 CLIP (77) and T5 (L) tokens [77 + L, 4096] + pooled [2048]; QwenImage
    Qwen2.5-VL [L, 3584] + an int64 mask. Latents and text in ``backbone.dtype``.
    """
    backbone, family = config.backbone, config.backbone.family
    height, width, dtype = backbone.height, backbone.width, backbone.dtype
    defaults = {"flux": 512, "sd3": 256, "qwenimage": QWEN_PROMPT_TOKENS}
    text = backbone.max_sequence_length or defaults[family]
    if family == "sd3":
        latent: tuple[int, ...] = (16, height // 8, width // 8)
        cond = {
            "prompt_embeds": ((77 + text, 4096), dtype),
            "pooled_prompt_embeds": ((2048,), dtype),
        }
    else:
        latent = ((height // 16) * (width // 16), 64)
        if family == "flux":
            cond = {"prompt_embeds": ((text, 4096), dtype), "pooled_prompt_embeds": ((768,), dtype)}
        else:
            text = min(text, QWEN_PROMPT_TOKENS)
            cond = {
                "prompt_embeds": ((text, 3584), dtype),
                "prompt_embeds_mask": ((text,), "int64"),
            }
    return SampleLayout(config.sampler.num_steps, latent, dtype, cond, (3, height, width))


def flux_rollouts(config_file: Path) -> dict[str, Any]:
    """Flux.1-dev, 1024 px, 28 steps all SDE, 16 trained: bytes per sample from the shapes."""
    base = base_config_data(config_file)
    layout = layout_for(config_with(base, FLUX_DEV_ROLLOUT))
    rows = []
    for name, overrides in ROLLOUT_SETTINGS.items():
        config = config_with(base, [*FLUX_DEV_ROLLOUT, *overrides])
        rows.append(_velocity_row(config, layout, name))
    return {"overrides": FLUX_DEV_ROLLOUT, "layout": dataclasses.asdict(layout), "rows": rows}


# ------------------------------------------------------------------------------------------
# sha256 throughput
# ------------------------------------------------------------------------------------------


def sha256_throughput(workdir: Path, size: int = 1 << 30) -> dict[str, float]:
    """Bytes per second hashing a ``size`` file, from the page cache and from the disk."""
    from jagg_pipeline.io.manifest import file_sha256

    path = workdir / "sha256-probe.bin"
    chunk = os.urandom(64 << 20)
    with open(path, "wb") as handle:
        for _ in range(size // len(chunk)):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    results = {"bytes": float(size)}
    start = time.perf_counter()
    file_sha256(path)  # as the stage manifests hash a file (uncached here)
    results["cached_bytes_per_s"] = size / (time.perf_counter() - start)
    _drop_page_cache(workdir)
    start = time.perf_counter()
    file_sha256(path)
    results["disk_bytes_per_s"] = size / (time.perf_counter() - start)
    path.unlink()
    return results


# ------------------------------------------------------------------------------------------
# Projection
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
# The projection's rollouts: each family at 1024 px in bf16, the Flux.1-dev setting's sampler.
PROJECTION_BACKBONES: dict[str, list[str]] = {
    "Flux.1-dev": [],
    "QwenImage": ["backbone.family=qwenimage", "backbone.max_sequence_length=null"],
    "SD3.5-medium": ["backbone.family=sd3", "backbone.max_sequence_length=null"],
}
NODE_RANKS = 8
ROUNDS, KEEP_EVERY = 300, 50
BYTES_PER_PARAM = {"bf16": 6, "fp32": 12, "ema_bf16": 2}  # weights + 2 AdamW moments; EMA copy
TRAINED_STEPS = 16


def keep_plan(config: Any, keep_every: int | None) -> dict[str, Any]:
    """Rounds ``workflow.keep_every`` keeps and the most checkpoints (rollouts) on disk at once."""
    from jagg_pipeline.workflow.runs import kept_rounds

    rounds = config.train.rounds
    kept = kept_rounds(config, keep_every)
    # While round r trains: the kept rounds so far, round r - 1 (its policy) and round r.
    most = max(len({k for k in kept if k < r} | {r - 1, r} - {-1}) for r in range(rounds))
    return {
        "eval_every": config.eval.every,
        "keep_every": keep_every,
        "kept": kept,
        "most_on_disk": most,
    }


def disk_plan(config_file: Path, eval_every: int) -> dict[str, Any]:
    """:func:`keep_plan` of the projection's run at ``eval_every``, keeping every 50th round."""
    base = base_config_data(config_file)
    return keep_plan(config_with(base, [*FLUX_DEV_ROLLOUT, f"eval.every={eval_every}"]), KEEP_EVERY)


FAMILY_MODELS = {"flux": "Flux.1-dev", "qwenimage": "QwenImage", "sd3": "SD3.5-medium"}


def preset_rows(folder: Path) -> list[dict[str, Any]]:
    """The project's presets as written: rollout bytes before/now, checkpoint, kept rounds."""
    from jagg_pipeline.config.tools import read_yaml
    from jagg_pipeline.workflow.sections import split

    rows = []
    for path in sorted(folder.glob("*.yaml")):
        base, workflow = split(read_yaml(path))
        config = config_with(base, [])
        layout = layout_for(config)
        row = _velocity_row(config, layout, path.stem)
        sampler, backbone = config.sampler, config.backbone
        samples = sampler.prompts_per_round * sampler.group_size
        checkpoint = None
        if backbone.training == "full":
            cls_name, kwargs = MODELS[FAMILY_MODELS[backbone.family]]
            # AdamW keeps its moments in the weights' dtype; an EMA is one more weight copy.
            per_param = 3 + (config.train.ema_decay is not None)
            checkpoint = count_parameters(cls_name, kwargs) * per_param * _itemsize(backbone.dtype)
        row |= {
            "family": backbone.family,
            "size": f"{backbone.height}x{backbone.width}",
            "steps": sampler.num_steps,
            "dtype": backbone.dtype,
            "mixed_precision": backbone.mixed_precision,
            "training": backbone.training,
            "samples_per_round": samples,
            "rollout_before_as_stored": samples * row["before_as_stored"],
            "rollout_now": samples * row["now"],
            "checkpoint": checkpoint,
            "keep_own": keep_plan(config, workflow.keep_every),
            "keep_50": keep_plan(config, KEEP_EVERY),
        }
        rows.append(row)
    return rows


def project(
    rehearsal_overheads: dict[str, float] | None, sha: dict[str, float], config_file: Path
) -> dict[str, Any]:
    """Per model: checkpoint, host RAM, disk for 300 rounds, rollout, base load, sha256."""
    plans = {every: disk_plan(config_file, every) for every in (KEEP_EVERY, 10)}
    most = plans[KEEP_EVERY]["most_on_disk"]
    speed = sha["cached_bytes_per_s"]
    base = base_config_data(config_file)
    rows = []
    for name, (cls_name, kwargs) in MODELS.items():
        params = count_parameters(cls_name, kwargs)
        checkpoint = params * BYTES_PER_PARAM["bf16"]
        shard = checkpoint / NODE_RANKS
        layout = layout_for(config_with(base, [*FLUX_DEV_ROLLOUT, *PROJECTION_BACKBONES[name]]))
        rest = layout.bytes_without_velocities()
        velocity = layout.velocity_bytes("bfloat16")
        velocity_f32 = layout.velocity_bytes("float32")
        rollout = {
            "before_f32": SAMPLES_PER_ROUND * (rest + TRAINED_STEPS * velocity_f32),
            "before_bf16": SAMPLES_PER_ROUND * (rest + TRAINED_STEPS * velocity),
            "now_exact": SAMPLES_PER_ROUND * rest,
            "now_jagg_f0.5": SAMPLES_PER_ROUND * (rest + TRAINED_STEPS // 2 * velocity),
            "now_jagg_f1": SAMPLES_PER_ROUND * (rest + TRAINED_STEPS * velocity),
        }
        # The manifests' input checks, per process and round: every rollout rank hashes the
        # policy checkpoint; every train rank the checkpoint and the whole rollout.
        rollout_rank = checkpoint / speed
        train_rank = (checkpoint + rollout["now_jagg_f1"]) / speed
        row: dict[str, Any] = {
            "model": name,
            "parameters": params,
            "checkpoint_bf16": checkpoint,
            "checkpoint_bf16_ema": checkpoint + params * BYTES_PER_PARAM["ema_bf16"],
            "checkpoint_fp32": params * BYTES_PER_PARAM["fp32"],
            "shard_bf16": shard,
            "checkpoints_300_all": ROUNDS * checkpoint,
            "checkpoints_300_keep": most * checkpoint,
            "rollout_per_round": rollout,
            "rollouts_300_all_now": ROUNDS * rollout["now_jagg_f1"],
            "rollouts_300_keep_now": most * rollout["now_jagg_f1"],
            "base_load_per_rank": params * 2,
            "base_load_per_node": params * 2 * NODE_RANKS,
            "sha256_s_rollout_rank": rollout_rank,
            "sha256_s_train_rank": train_rank,
            "sha256_hours_300_rounds": ROUNDS * (rollout_rank + train_rank) / 3600,
            "sha256_bytes_per_node_round": NODE_RANKS * (2 * checkpoint + rollout["now_jagg_f1"]),
        }
        if rehearsal_overheads is not None:
            gathered = rehearsal_overheads["gathered_rank0_per_checkpoint_byte"]
            sharded = rehearsal_overheads["sharded_per_shard_byte"]
            row["save_ram_gathered_rank0"] = gathered * checkpoint
            row["save_ram_sharded_per_rank"] = sharded * shard
            row["save_ram_limit_per_rank"] = TARGET_FACTOR * shard + TARGET_EXTRA
        rows.append(row)
    return {
        "assumptions": {
            "ranks": NODE_RANKS,
            "bytes_per_param": BYTES_PER_PARAM,
            "rounds": ROUNDS,
            "keep_every": KEEP_EVERY,
            "samples_per_round": SAMPLES_PER_ROUND,
            "steps": 28,
            "trained_steps": TRAINED_STEPS,
            "sha256_bytes_per_s": speed,
        },
        "disk_plans": plans,
        "rows": rows,
    }


# ------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, columns right-aligned but the first."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        first, *rest = row
        right = (c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))
        return "  ".join([first.ljust(widths[0]), *right])

    return "\n".join([line(cells[0]), line(["-" * w for w in widths]), *map(line, cells[1:])])


def gb(value: float) -> str:
    """Bytes as GB (1e9) with two decimals."""
    return f"{value / GB:.2f}"


def mb(value: float) -> str:
    """Bytes as MB (1e6) with two decimals."""
    return f"{value / 1e6:.2f}"


def print_rehearsal(model: dict[str, Any], rehearsal: dict[str, Any]) -> None:
    """The per-variant, per-rank table and the target check."""
    kwargs = model["kwargs"]
    print(
        f"\nRehearsal: FluxTransformer2DModel, {kwargs['num_layers']} double + "
        f"{kwargs['num_single_layers']} single blocks, {kwargs['num_attention_heads']} heads x "
        f"{kwargs['attention_head_dim']}: {model['parameters']:,} parameters (float32), "
        f"AdamW, FSDP2 on {RANKS} gloo ranks"
    )
    rows = []
    for variant in VARIANTS:
        result = rehearsal[variant]
        for save, load in zip(result["save"], result["load"], strict=True):
            rows.append(
                [
                    variant,
                    save["rank"],
                    gb(save["shard"]),
                    f"{save['seconds']:.1f}",
                    f"{load['seconds']:.1f}",
                    gb(result["disk_bytes"]),
                    gb(save["rss_before"]),
                    gb(save["rss_peak"]),
                    gb(save["rss_peak"] - save["rss_before"]),
                    gb(load["rss_before"]),
                    gb(load["rss_peak"]),
                    gb(load["rss_peak"] - load["rss_before"]),
                    "yes" if load["exact"] else f"NO {load['differing_tensors']}",
                ]
            )
    headers = [
        "variant",
        "rank",
        "shard GB",
        "save s",
        "load s",
        "disk GB",
        "save RSS before",
        "save peak",
        "save +",
        "load RSS before",
        "load peak",
        "load +",
        "exact",
    ]
    print(table(headers, rows))
    print("(GB = 1e9 bytes; 'disk GB' is the whole checkpoint; '+' = peak - RSS before)")
    for variant in VARIANTS:
        for phase in ("save", "load"):
            rank0 = rehearsal[variant][phase][0]
            parts = ", ".join(f"{k} {v:.1f}" for k, v in rank0["parts"].items())
            print(f"rank 0 {variant} {phase} seconds: {parts}")
    for check in target_check(rehearsal):
        verdict = "PASS" if check["pass"] else "FAIL"
        print(
            f"target rank {check['rank']}: sharded save peak RSS {gb(check['peak'])} GB <= "
            f"1.5 x shard {gb(check['shard'])} GB + 1 GB = {gb(check['limit'])} GB: {verdict}"
        )


def print_rollouts(
    name: str, result: dict[str, Any], measured: bool, unit: tuple[str, float] = ("MB", 1e6)
) -> None:
    """Bytes per sample per setting, before and now, in ``unit`` (name, bytes)."""
    label, size = unit

    def show(value: float) -> str:
        return f"{value / size:.2f}"

    print(f"\nRollout bytes per sample: {name}")
    headers = ["setting", "trained", "stored now", "dtype now", f"before f32 {label}"]
    headers += [f"before (as stored) {label}", f"now {label}", "now / before f32"]
    if measured:
        headers.append(f"file {label} / sample")
    rows = []
    for row in result["rows"]:
        line = [
            row["setting"],
            row["trained_steps"],
            row["velocity_steps_now"],
            row["velocity_dtype_now"],
            show(row["before_f32"]),
            show(row["before_as_stored"]),
            show(row["now"]),
            f"{row['now'] / row['before_f32']:.2f}",
        ]
        if measured:
            line.append(show(row["file_bytes_per_sample"]))
        rows.append(line)
    print(table(headers, rows))


def print_projection(projection: dict[str, Any], sha: dict[str, float]) -> None:
    """The projection tables."""
    plans = projection["disk_plans"]
    most = plans[KEEP_EVERY]["most_on_disk"]
    print(
        f"\nProjection: full fine-tuning, AdamW, {NODE_RANKS} ranks, bf16 weights and moments "
        "(6 B/param; EMA +2 B/param; fp32 12 B/param)"
    )
    rows = []
    for row in projection["rows"]:
        ram = [
            gb(row[key]) if key in row else "-"
            for key in (
                "save_ram_gathered_rank0",
                "save_ram_sharded_per_rank",
                "save_ram_limit_per_rank",
            )
        ]
        rows.append(
            [
                row["model"],
                f"{row['parameters'] / 1e9:.2f}",
                gb(row["checkpoint_bf16"]),
                gb(row["checkpoint_bf16_ema"]),
                gb(row["checkpoint_fp32"]),
                gb(row["shard_bf16"]),
                *ram,
            ]
        )
    headers = ["model", "B params", "ckpt GB", "+EMA GB", "fp32 GB", "shard/rank GB"]
    headers += ["save +RAM gathered r0", "save +RAM sharded/rank", "limit/rank"]
    print(table(headers, rows))
    verdict = "met" if most <= 7 else "NOT met"
    print(
        f"\n{ROUNDS} rounds, keep_every {KEEP_EVERY} (eval.every {KEEP_EVERY}): kept rounds "
        f"{plans[KEEP_EVERY]['kept']}, at most {most} checkpoints (and rollouts) on disk at "
        f"once: target <= 7 {verdict}; with eval.every 10 every evaluated round is kept too: "
        f"{len(plans[10]['kept'])} kept, at most {plans[10]['most_on_disk']} on disk"
    )
    rows = []
    for row in projection["rows"]:
        rollout = row["rollout_per_round"]
        rows.append(
            [
                row["model"],
                gb(row["checkpoints_300_all"]),
                gb(row["checkpoints_300_keep"]),
                gb(rollout["before_f32"]),
                gb(rollout["before_bf16"]),
                gb(rollout["now_exact"]),
                gb(rollout["now_jagg_f0.5"]),
                gb(rollout["now_jagg_f1"]),
                gb(row["rollouts_300_all_now"]),
                gb(row["rollouts_300_keep_now"]),
            ]
        )
    headers = ["model", "ckpts all 300", f"ckpts keep {KEEP_EVERY}", "rollout/round before f32"]
    headers += ["before bf16", "now exact", "now f=0.5", "now f=1", "rollouts all 300"]
    headers += [f"rollouts keep {KEEP_EVERY}"]
    print(f"Disk, GB ({SAMPLES_PER_ROUND} samples a round; 'all 300' / 'keep' at now f=1)")
    print(table(headers, rows))
    rows = [
        [
            row["model"],
            gb(row["base_load_per_rank"]),
            gb(row["base_load_per_node"]),
            f"{row['sha256_s_rollout_rank']:.0f}",
            f"{row['sha256_s_train_rank']:.0f}",
            gb(row["sha256_bytes_per_node_round"]),
            f"{row['sha256_hours_300_rounds']:.1f}",
        ]
        for row in projection["rows"]
    ]
    headers = ["model", "base load GB/rank", "GB/node", "sha256 s/rollout rank"]
    headers += ["s/train rank", "GB hashed/node/round", f"h per {ROUNDS} rounds"]
    print("\nWhat still scales with the whole model per rank")
    print(table(headers, rows))
    print(
        f"sha256 here: {sha['cached_bytes_per_s'] / GB:.2f} GB/s from the page cache, "
        f"{sha['disk_bytes_per_s'] / GB:.2f} GB/s after dropping the file from it (one core, "
        "1 MiB reads, as the manifests hash)"
    )


def print_presets(rows: Sequence[dict[str, Any]]) -> None:
    """The presets' rollouts and checkpoints, as configured."""
    print("\nThe project's presets as written (rollout from their shapes, before = as stored)")
    lines = []
    for row in rows:
        own, fifty = row["keep_own"], row["keep_50"]
        lines.append(
            [
                row["setting"],
                row["size"],
                f"{row['dtype']}/{row['mixed_precision']}",
                row["steps"],
                row["trained_steps"],
                f"{row['velocity_steps_now']} {row['velocity_dtype_now']}",
                mb(row["before_as_stored"]),
                mb(row["now"]),
                row["samples_per_round"],
                gb(row["rollout_before_as_stored"]),
                gb(row["rollout_now"]),
                "LoRA" if row["checkpoint"] is None else gb(row["checkpoint"]),
                f"{own['keep_every']}: {len(own['kept'])}/{own['most_on_disk']}",
                f"{len(fifty['kept'])}/{fifty['most_on_disk']} (eval {fifty['eval_every']})",
            ]
        )
    headers = ["preset", "px", "dtype/mp", "steps", "trained", "stored now", "MB before"]
    headers += ["MB now", "samples", "GB/round before", "now", "ckpt GB", "keep_every: kept/most"]
    headers += [f"keep {KEEP_EVERY}: kept/most"]
    print(table(headers, lines))


def machine() -> dict[str, Any]:
    """What the measurements ran on."""
    import torch

    cpu = ""
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if "model name" in line)
    except (OSError, StopIteration):
        pass
    memory = _meminfo("MemTotal")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def _meminfo(name: str) -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=5e8, help="rehearsal model size")
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the measurements")
    parser.add_argument(
        "--config", type=Path, default=Path("config.yaml"), help="the workflow config file"
    )
    parser.add_argument("--presets", type=Path, default=Path("presets"), help="the presets folder")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where checkpoints go (default: a temp dir)"
    )
    parser.add_argument("--skip-rehearsal", action="store_true", help="rollout/projection only")
    # Internal: one rank of one operation.
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Rehearse, count, project; print the tables and write the JSON."""
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    workdir = Path(tempfile.mkdtemp(prefix="scale-rehearsal-", dir=args.workdir))
    try:
        model = choose_flux(args.params)
        print(
            f"model: {model['kwargs']} -> {model['parameters']:,} parameters "
            f"(target {args.params:,.0f})",
            flush=True,
        )
        rehearsal, ratios = None, None
        if not args.skip_rehearsal:
            rehearsal = rehearse(model, workdir)
            ratios = overheads(rehearsal)
            print_rehearsal(model, rehearsal)
        toy = toy_rollouts(args.config, workdir)
        flux = flux_rollouts(args.config)
        print_rollouts(
            f"toy world default config ({args.config}), measured", toy, True, ("kB", 1e3)
        )
        print_rollouts("Flux.1-dev, 1024 px, 28 steps all SDE, 16 trained, bf16", flux, False)
        presets = preset_rows(args.presets)
        print_presets(presets)
        sha = sha256_throughput(workdir)
        projection = project(ratios, sha, args.config)
        print_projection(projection, sha)
        if ratios is not None:
            print("\nmeasured overheads:", json.dumps(ratios, indent=1))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.out:
        record = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine(),
            "model": model,
            "rehearsal": rehearsal,
            "target": None if rehearsal is None else target_check(rehearsal),
            "overheads": ratios,
            "rollout_toy": toy,
            "rollout_flux": flux,
            "presets": presets,
            "sha256": sha,
            "projection": projection,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
