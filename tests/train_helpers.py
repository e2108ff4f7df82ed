"""Shared pieces of the training tests, and the torchrun worker of the FSDP2 checks.

Imported by tests/test_train*.py and tests/test_distributed*.py: a tiny SD3 checkpoint (float64,
so that equalities can be stated to ~1e-12), configs, scored rollouts made by the real rollout
and score stages, and subprocess runners (one thread, a free port, a hard timeout).

Run as a script under ``torchrun`` it is the worker of tests/test_distributed.py::
``python train_helpers.py CHECKPOINT OUT.json`` counts FSDP2 reduce-scatters per backward
unit and checks that the ranks' gradients are summed, not averaged.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# 4 prompts x 4 samples, 9 steps with noise on all (8 trained: the last never is), sampled in
# 2 micro-batches of 2 groups.
SAMPLER = {
    "num_steps": 9,
    "group_size": 4,
    "prompts_per_round": 4,
    "batch_size": 8,
    "trajectory": "full",
}


def flip_byte(path: Path) -> None:
    """Damage ``path`` in place: one bit flipped in the tensor data, past the header; a second
    call restores it."""
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0x01
    path.write_bytes(bytes(data))


def config_data(checkpoint: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A tiny experiment (float64 SD3 at ``checkpoint``, JPEG reward) with section updates."""
    data: dict[str, Any] = {
        "backbone": {
            "family": "sd3",
            "path": str(checkpoint),
            "height": 32,
            "width": 32,
            "dtype": "float64",
            "training": "full",
            "max_sequence_length": 16,
        },
        "sampler": dict(SAMPLER),
        "rewards": {"weights": {"jpeg_compressibility": 1.0}},
        "train": {"rounds": 4, "lr": 1e-4, "minibatches": 1},
        "jagg": {"mode": "jagg", "window": 4, "jagg_frac": 1.0},
        "tracking": {"backend": "none"},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return data


def make_config(checkpoint: Path, **sections: dict[str, Any]):
    """The :class:`RunConfig` of :func:`config_data`."""
    from jagg_pipeline.config.run import from_mapping

    return from_mapping(config_data(checkpoint, **sections))


def write_config(config: Any, path: Path) -> Path:
    """``config`` as a YAML file for the command line."""
    import yaml

    from jagg_pipeline.config.tools import to_dict

    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return path


def scored_rollout(
    config: Any, directory: Path, policy: str | Path = "base", round_index: int = 0
) -> tuple[Path, Path]:
    """Rollout and score folder of ``policy`` made by the real stages: (rollouts, scores)."""
    from jagg_pipeline.stages.rollout import run_rollout
    from jagg_pipeline.stages.scoring import run_score

    rollouts, scores = directory / "rollout", directory / "scores"
    run_rollout(config, policy, "toy:train", rollouts, round_index=round_index, progress=False)
    run_score(config, rollouts, scores)
    return rollouts, scores


def forged_scores(scores: Path, target: Path, rows: list[dict], *, reseal: bool = True) -> Path:
    """A copy of the score folder ``scores`` whose table holds ``rows``.

    ``reseal``: record the forged table's digest in the manifest too, as if the score stage
    had written it (what the tests of training on unusual tables need); False leaves the
    manifest as it was, which the integrity check refuses.
    """
    import shutil

    from jagg_pipeline.io.manifest import file_digests, manifest_path
    from jagg_pipeline.io.tables import write_table
    from jagg_pipeline.stages.scoring import table_path

    shutil.copytree(scores, target)
    write_table(table_path(target), rows)
    if reseal:
        manifest = json.loads(manifest_path(target).read_text())
        manifest["files"] = file_digests(target)
        manifest_path(target).write_text(json.dumps(manifest))
    return target


def policy_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The weights a checkpoint's ``policy/`` holds (full or LoRA), read in this process."""
    from jagg_pipeline.io import shards

    return shards.read(checkpoint / "policy")


def base_weights(pipeline: Path) -> dict[str, torch.Tensor]:
    """A pipeline directory's transformer weights, in float64 as the test backbones hold them."""
    from safetensors.torch import load_file

    weights = load_file(str(pipeline / "transformer" / "diffusion_pytorch_model.safetensors"))
    return {name: tensor.double() for name, tensor in weights.items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute element difference between two state dicts with the same keys."""
    assert set(a) == set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def subprocess_env() -> dict[str, str]:
    """One thread per process (2-core machine), no hub, the repository importable."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    return env


def launcher(nproc: int | None) -> list[str]:
    """``python`` for one process, ``torchrun`` on a free port for ``nproc``."""
    if nproc is None:
        return [PYTHON]
    return [
        TORCHRUN,
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]


def run_train_command(
    args: list[str], nproc: int | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """``python -m jagg_pipeline train ARGS`` (under torchrun with ``nproc``); must succeed."""
    return run_command("train", args, nproc, timeout)


def torchrun(command: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m jagg_pipeline COMMAND ARGS`` on two gloo ranks; must succeed."""
    return run_command(command, list(args), nproc=2)


def run_command(
    name: str, args: list[str], nproc: int | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """``python -m jagg_pipeline NAME ARGS`` (under torchrun with ``nproc``); must succeed."""
    command = [*launcher(nproc), "-m", "jagg_pipeline", name, *args]
    result = subprocess.run(
        command, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@functools.cache
def _tiny_sd3(root: Path) -> Path:
    from jagg_pipeline.toyworld.tiny import save_tiny_pipeline

    return save_tiny_pipeline("sd3", root / "tiny-sd3", seed=0)


@functools.cache
def _base_rollout(root: Path) -> tuple[Path, Path]:
    return scored_rollout(make_config(_tiny_sd3(root)), root / "base-round")


# Fixtures, imported by the test modules. Each module registers its own copy, so the work is
# cached per session root rather than per fixture.
@pytest.fixture(scope="session", name="tiny_sd3")
def tiny_sd3_fixture(tmp_path_factory) -> Path:
    """A tiny random SD3 pipeline directory (built once per session)."""
    return _tiny_sd3(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session", name="base_rollout")
def base_rollout_fixture(tmp_path_factory) -> tuple[Path, Path]:
    """Round 0's scored rollout of the base policy under the default test sampler."""
    return _base_rollout(tmp_path_factory.getbasetemp())


# --------------------------------------------------------------------------------------------
# The torchrun worker
# --------------------------------------------------------------------------------------------


def _worker(checkpoint: Path, out: Path) -> None:
    from jagg_pipeline.backbones import BackboneConfig, load_backbone
    from jagg_pipeline.core import jagg
    from jagg_pipeline.core.objective import GRPOStepLoss, recompute_log_probs
    from jagg_pipeline.core.sde import StepCoefficients
    from jagg_pipeline.stages import distributed

    torch.set_num_threads(1)
    counter = distributed.count_reduce_scatters()
    spec = BackboneConfig(
        family="sd3",
        path=str(checkpoint),
        height=32,
        width=32,
        dtype="float64",
        training="full",
        max_sequence_length=16,
    )
    with distributed.distributed("cpu") as ctx:
        reference = load_backbone(spec)  # unsharded, sees all the data
        sharded = load_backbone(dataclasses.replace(spec, load_text_encoders=False))
        # FSDP2 renames the classes it shards, so count the units (+ the root) first.
        groups = len(sharded.fsdp_units()) + 1
        distributed.shard_backbone(sharded, ctx)

        # 4 samples, 5 steps; rank r holds samples 2r, 2r + 1.
        gen = torch.Generator().manual_seed(0)
        batch, steps = 4, [0, 1, 2, 3]
        sigmas = reference.sigmas(5).double()
        latents = torch.randn(batch, 6, *reference.latent_shape, generator=gen, dtype=torch.float64)
        cond = reference.encode_prompts(["a red circle on the left, white background"] * batch)
        coeffs = StepCoefficients("flow_grpo", 0.7)
        old = torch.zeros(batch, 5, dtype=torch.float64)
        old[:, steps] = recompute_log_probs(
            reference.velocity, latents, sigmas, cond, steps, coeffs
        )
        advantages = torch.randn(batch, generator=gen, dtype=torch.float64)

        def part(index: list[int]) -> jagg.MicroBatch:
            sub_cond = {k: v[index] for k, v in cond.items()}
            objective = GRPOStepLoss(
                latents[index],
                sigmas,
                old[index],
                advantages[index],
                steps,
                coeffs,
                1e-4,
                normalizer=float(batch * len(steps)),
                cond=sub_cond,
            )
            return jagg.MicroBatch(latents[index], sigmas, sub_cond, objective)

        report: dict[str, Any] = {"groups": groups, "world_size": ctx.world_size}
        params = sharded.trainable_parameters()
        mine = part([2 * ctx.rank, 2 * ctx.rank + 1])
        distributed.set_gradient_sync(sharded.transformer, True)
        # (name, mode, endpoint backward): the joint one stacks both endpoints in one call.
        for name, mode, backward in (
            ("jagg", "jagg", "joint"),
            ("sequential_jagg", "jagg", "sequential"),
            ("exact", "exact", "joint"),
        ):
            before = counter["calls"]
            jagg.window_gradient(
                sharded.velocity,
                mine.objective,
                mine.latents,
                sigmas,
                mine.cond,
                steps,
                mode,
                endpoint_backward=backward,
            )
            report[f"{name}_window_reduce_scatters"] = counter["calls"] - before
            for p in params:
                p.grad = None

        # One optimizer step's accumulation: 2 micro-batches x 2 windows (jagg + exact).
        before = counter["calls"]
        parts = [part([2 * ctx.rank]), part([2 * ctx.rank + 1])]
        jagg.accumulate_gradient(
            sharded.velocity,
            parts,
            [[0, 1], [2, 3]],
            [True, False],
            "jagg",
            lambda on: distributed.set_gradient_sync(sharded.transformer, on),
        )
        report["step_reduce_scatters"] = counter["calls"] - before

        # The summed sharded gradient against one process's gradient over all 4 samples.
        got = [distributed.full_tensor(p.grad) for p in params]
        everything = part(list(range(batch)))
        jagg.trajectory_gradient(
            reference.velocity,
            everything.objective,
            latents,
            sigmas,
            cond,
            steps,
            window=2,
            mode="jagg",
            routing=[True, False],
        )
        expected = [p.grad for p in reference.trainable_parameters()]
        report["max_grad_difference"] = max(
            float((g - e).abs().max()) for g, e in zip(got, expected, strict=True)
        )
        report["max_grad"] = max(float(e.abs().max()) for e in expected)
        if ctx.is_main:
            out.write_text(json.dumps(report))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))


def assert_same_checkpoint(got: Path, want: Path) -> None:
    """Two checkpoint folders hold the same bytes (metrics lines compared without timings)."""

    def files(folder: Path) -> dict[str, bytes]:
        return {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }

    def without_times(metrics: bytes) -> list[dict]:
        rows = [json.loads(line) for line in metrics.decode().splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith("time.")} for row in rows]

    ours, theirs = files(got), files(want)
    assert set(ours) == set(theirs)
    for name in ours:
        if name == "metrics.jsonl":
            assert without_times(ours[name]) == without_times(theirs[name])
        else:
            assert ours[name] == theirs[name], name
