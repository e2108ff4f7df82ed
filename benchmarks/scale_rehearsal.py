"""Checkpoint rehearsal: what saving and loading a sharded training state costs in memory and time.

A Flux-architecture transformer (diffusers ``FluxTransformer2DModel``, random float32 weights,
about ``--params`` parameters) is FSDP2-sharded (each block, then the root) on 2 gloo ranks,
with AdamW state created by one step on random gradients. Two checkpoint mechanisms, each save
and each load in its own ``torchrun`` job so that every peak RSS belongs to one operation:

- ``gathered``: full model and optimizer state dicts gathered to rank 0's CPU
  (``full_state_dict``, ``cpu_offload``) and written there as two safetensors files; loaded
  back by rank 0 reading both files and broadcasting (``broadcast_from_rank0``);
- ``sharded``: every rank writes its own shards, :func:`jagg_pipeline.io.shards.save` of
  :func:`~jagg_pipeline.stages.distributed.model_state_dict` and
  :func:`~jagg_pipeline.stages.distributed.optimizer_state_dict` (the checkpoints the train
  stage writes); loaded back into fresh sharded templates as the train stage resumes
  (:func:`jagg_pipeline.stages.policy.load_weights`, :func:`jagg_pipeline.io.shards.load`,
  ``distributed.load_*``).

Per mechanism and rank: seconds (barrier to barrier), bytes on disk, the rank's shard (its
local parameters + optimizer state), and the peak RSS during save and load, absolute and above
the RSS just before (a thread polls ``VmRSS`` every 20 ms; the kernel's high-water mark
``VmHWM``, reset before each operation, catches what the poller misses). Every load is checked
byte for byte: sha256 of each local weight and moment after the load equals the saved rank's.
The target: the sharded save's peak RSS per rank <= 1.5 x its shard + 1 GB. Files are fsynced
when written (as the checkpoint code does) and dropped from the page cache before loading
(``posix_fadvise``), so loads read the disk. The JSON (``--out``) holds the measured RSS
growth per byte saved (``overheads``), which ``scale_projection.py --rehearsal`` scales to
the real models.

    python benchmarks/scale_rehearsal.py --params 5e8 --out results/bench/scale_rehearsal.json
    python benchmarks/scale_rehearsal.py --params 20e6  # smoke run: start-up of 4 jobs dominates

Linux only (``/proc/self/status``). Each rank runs one thread (2 ranks on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import SAVE_TARGET, PeakRss, choose_flux, drop_page_cache, gb, machine, rss, table

if TYPE_CHECKING:
    import torch
    from torch import nn

RANKS = 2
VARIANTS = ("gathered", "sharded")
POLICY_FILE = "policy.safetensors"  # the gathered mechanism's two files
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_PREFIX = "state/"

# ------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------


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
# The two checkpoint mechanisms (run in the workers)
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
    """Full state dicts on rank 0's CPU, written there with safetensors."""
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
    """Rank 0 reads both files and broadcasts; every rank keeps its shards."""
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
        drop_page_cache(folder)
        load = run_operation(variant, "load", model, folder)
        shutil.rmtree(folder)
        results[variant] = {"disk_bytes": disk, "files": files, "save": save, "load": load}
    return results


def target_check(rehearsal: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank: sharded save's peak RSS against 1.5 x shard + 1 GB."""
    rows = []
    for record in rehearsal["sharded"]["save"]:
        limit = SAVE_TARGET[0] * record["shard"] + SAVE_TARGET[1]
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


def print_rehearsal(model: dict[str, Any], rehearsal: dict[str, Any]) -> None:
    """The per-mechanism, per-rank table and the target check."""
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
        "checkpoint",
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=5e8, help="rehearsal model size")
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the measurements")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where checkpoints go (default: a temp dir)"
    )
    # Internal: one rank of one operation.
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Rehearse both mechanisms; print the table and write the JSON."""
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
        rehearsal = rehearse(model, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    ratios = overheads(rehearsal)
    print_rehearsal(model, rehearsal)
    print("\nmeasured overheads:", json.dumps(ratios, indent=1))
    if args.out:
        record = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine(),
            "model": model,
            "rehearsal": rehearsal,
            "target": target_check(rehearsal),
            "overheads": ratios,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
