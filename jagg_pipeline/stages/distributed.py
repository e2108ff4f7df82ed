"""Parallelism in one place: the process group, the device mesh, FSDP2 sharding, state dicts.

The only module that imports ``torch.distributed.fsdp`` or the device mesh.
Training always runs under FSDP2 (``fully_shard``), with one code path for every world size:

- under ``torchrun`` the process group is initialised from its environment (gloo on CPU, NCCL
  on CUDA, one device per local rank);
- a plain single process (no ``torchrun``) gets a world of one over an in-memory store, so
  the same sharded code, collectives and state-dict helpers run unchanged.

Gradients are SUMMED across ranks (FSDP2 averages by default): the training objective is
normalised by the global sample count, so the sum of the ranks' gradients is the
single-process gradient (:func:`shard_backbone`). State dicts stay sharded: each rank
hands its own shards to :mod:`jagg_pipeline.stages.checkpoint` and loads its own back, so no rank
ever holds the whole model or optimizer state.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from jagg_pipeline.backbones.base import Backbone
from jagg_pipeline.io.shards import local_tensor
from jagg_pipeline.support.errors import InputError
from jagg_pipeline.support.lifetime import RANK_THREADS_ENV

# Frozen parameters (a LoRA base model, dead modules) never change: the base checkpoint has them.
_TRAINABLE = StateDictOptions(ignore_frozen_params=True)

# FSDP2 warns whenever a wrapped module returns a view: an in-place op on that view after the
# forward can bypass the pre-backward hook FSDP2 registers on it (the all-gather before the
# module's backward). These modules return views that nothing modifies in place:
# - FluxSingleTransformerBlock returns its text and image tokens as two slices of the joint
#   residual stream; the next block concatenates them, norm_out reads the last image slice
#   and the last text slice is dropped, all out of place;
# - the roots FluxTransformer2DModel and QwenImageTransformer2DModel return proj_out's
#   output, which nn.Linear gives on a 3-D input as a view of its 2-D matmul; the velocity is
#   only read out of place after that (Backbone.velocity, the JAGG engine, the objectives).
# tests/test_fsdp_views.py: float64 gradients at world sizes 1 and 2 equal the unwrapped
# model's to 1e-12 relative (Flux, QwenImage), and the warning stays on for other modules.
_HARMLESS_VIEW_WARNING = (
    r"FSDP2-wrapped module \(FSDP(FluxSingleTransformerBlock|FluxTransformer2DModel"
    r"|QwenImageTransformer2DModel)\) returned a view tensor\."
)


@dataclass(frozen=True)
class DistContext:
    """Who this process is: rank, world size, its device and the 1-D data-parallel mesh."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes files and prints progress."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether the environment of a ``torchrun`` worker is present."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def local_device(device: str) -> torch.device:
    """``device``, with an index-less ``cuda`` made ``cuda:LOCAL_RANK`` under torchrun."""
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        if torch_device.index is None:
            torch_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if torch_device.index >= visible:
            raise InputError(
                f"backbone.device: {device} needs CUDA device {torch_device.index}, but "
                f"{visible} are visible (CUDA_VISIBLE_DEVICES, train.nproc / "
                "--nproc_per_node); use backbone.device: cpu or fewer processes"
            )
        torch.cuda.set_device(torch_device)
    return torch_device


def barrier() -> None:
    """Wait for every rank (a no-op in a world of one)."""
    if dist.get_world_size() > 1:
        dist.barrier()


@contextmanager
def distributed(device: str = "cpu") -> Iterator[DistContext]:
    """Join (or create) the process group for ``device``'s type; tear down what was created.

    ``device`` is the backbone's device setting (``cpu``, ``cuda``, ``cuda:N``); under
    ``torchrun`` an index-less ``cuda`` becomes ``cuda:LOCAL_RANK`` (as the rollout stage
    does). If a process group already exists (e.g. a caller runs several rounds in one
    process), it is used and left alone.
    """
    pin_rank_threads()
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    created = not dist.is_initialized()
    torchrun = launched_by_torchrun()
    local_rank = int(os.environ["LOCAL_RANK"]) if torchrun else 0
    torch_device = local_device(device)  # a missing GPU is refused before NCCL starts
    if created and torchrun:
        dist.init_process_group(backend)
    elif created:
        # A world of one: the same FSDP2 code path as under torchrun, no rendezvous.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(torch_device.type, (dist.get_world_size(),))
        yield DistContext(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            device=torch_device,
            mesh=mesh,
        )
    finally:
        if created:
            dist.destroy_process_group()


def pin_rank_threads() -> None:
    """Size torch's thread pools as the launch command asked (:data:`RANK_THREADS_ENV`).

    Its environment already pins OpenMP and MKL; the pools are set here too, so that no
    reduction's order depends on the cores the job was given.
    """
    threads = os.environ.get(RANK_THREADS_ENV)
    if threads is None:
        return
    torch.set_num_threads(int(threads))
    # Only settable before the process's first inter-op work.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(int(threads))


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sum of a list of floats over all ranks (in float64)."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def all_reduce_max(values: Sequence[float]) -> list[float]:
    """Element-wise maximum of a list of floats over all ranks (in float64)."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def _all_reduce(values: Sequence[float], op: dist.ReduceOp) -> list[float]:
    tensor = torch.tensor(list(values), dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op)
    return tensor.cpu().tolist()


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def gather_object(value: Any) -> list[Any] | None:
    """Every rank's ``value``, in rank order, on rank 0 (None on the others)."""
    values: list[Any] | None = [None] * dist.get_world_size() if is_main() else None
    dist.gather_object(value, values, dst=0)
    return values


def is_main() -> bool:
    """Whether this process is rank 0 of the process group (the one that writes files)."""
    return dist.get_rank() == 0


# --------------------------------------------------------------------------------------------
# Sharding
# --------------------------------------------------------------------------------------------


def shard_backbone(backbone: Backbone, ctx: DistContext, *, mixed_precision: bool = False) -> None:
    """``fully_shard`` every FSDP unit of the backbone, then its transformer as the root.

    Each unit is one parameter group (one all-gather in forward, one reduce-scatter per
    backward call that syncs). ``mixed_precision``: bf16 parameters in compute, fp32
    gradient reduction. Reductions are plain sums (divide factor 1, SUM ops only): the loss
    is already normalised by the global sample count, so summing the ranks' gradients gives
    the single-process gradient, where FSDP2's default average would divide it by the world
    size. ``backbone.transformer`` becomes the root :class:`FSDPModule`. FSDP2's warning
    about returned views is silenced for the Flux and QwenImage modules shown harmless.
    """
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    warnings.filterwarnings("ignore", message=_HARMLESS_VIEW_WARNING, category=UserWarning)
    for unit in [*backbone.fsdp_units(), backbone.transformer]:
        fully_shard(unit, mesh=ctx.mesh, mp_policy=policy)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def set_gradient_sync(root: nn.Module, enabled: bool) -> None:
    """Turn the reduce-scatter after each backward call on or off, for every group of ``root``.

    Off: FSDP2 accumulates unsharded gradients locally; the next backward call with sync on
    reduces the accumulated sum once.
    """
    if not isinstance(root, FSDPModule):
        raise TypeError(f"{type(root).__name__} is not sharded; call shard_backbone first")
    root.set_requires_gradient_sync(enabled)


def materialize(module: nn.Module, device: torch.device) -> set[str]:
    """Allocate a sharded module's meta parameters as this rank's local shards on ``device``.

    ``to_empty`` allocates every parameter's local shard (and every buffer) anew, unset; what
    was real before (buffers, LoRA adapters drawn at injection) gets its values back. Returns
    the names of the parameters that were on the meta device: the caller fills them (their
    rows: :func:`local_rows`) before the first forward, when FSDP2 takes up the local shards.
    """
    tensors = [*module.named_parameters(), *module.named_buffers()]
    empty = {name for name, tensor in tensors if local_tensor(tensor).is_meta}
    kept = {
        name: local_tensor(tensor).detach().clone() for name, tensor in tensors if name not in empty
    }
    module.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in kept:
                local_tensor(tensor).copy_(kept[name])
    return {name for name, _ in module.named_parameters()} & empty


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, slice | None]:
    """The calling rank's part of a parameter: its local tensor and the rows of dim 0 it is.

    FSDP2 shards each parameter by rows (``Shard(0)`` over the 1-D mesh); a tensor that is
    not sharded is held whole (None).
    """
    if not isinstance(tensor, DTensor):
        return tensor, None
    if tuple(tensor.placements) != (Shard(0),):
        raise ValueError(f"expected a parameter sharded by rows, got {tensor.placements}")
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"local shard of shape {tuple(local.shape)}, expected {shape}")
    return local, slice(offset[0], offset[0] + shape[0])


# --------------------------------------------------------------------------------------------
# Tensors and state dicts
# --------------------------------------------------------------------------------------------


def count_reduce_scatters() -> dict[str, int]:
    """Count the collectives FSDP2 reduces gradients with, from now on; the live counter.

    For measurements (the benchmark, the FSDP tests): wraps ``torch.distributed``'s
    reduce-scatter functions in this process for good.
    """
    counter = {"calls": 0}
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            counter["calls"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    return counter


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a sharded tensor (a collective: every rank must call it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def model_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of the module's state dict, as this rank's shards; collective.

    Frozen parameters and buffers are left out (the base checkpoint has them); keys are the
    module's own state-dict names. The values share storage with the parameters: loading
    into them in place loads the model.
    """
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    state = get_model_state_dict(module, options=_TRAINABLE)
    return {name: value for name, value in state.items() if name in trainable}


def load_model_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set the trainable parameters from a state dict shaped as :func:`model_state_dict`'s."""
    set_model_state_dict(module, state, options=StateDictOptions(strict=False))


def optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict, keyed by parameter name, as this rank's shards; collective.

    A fresh optimizer's state is created (zero moments) so that it can be loaded into.
    """
    return get_optimizer_state_dict(module, optimizer)


def load_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load a state dict shaped as :func:`optimizer_state_dict`'s; collective."""
    set_optimizer_state_dict(module, optimizer, state)
