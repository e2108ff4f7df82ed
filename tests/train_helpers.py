"""Shared pieces of the training tests.

Imported by tests/test_train*.py and tests/test_distributed*.py: a tiny SD3 checkpoint (float64,
so that equalities can be stated to ~1e-12), configs, scored rollouts made by the real rollout
and score stages, and subprocess runners (one thread, a free port, a hard timeout). Its
fixtures (``tiny_sd3``, ``base_rollout``) reach every test through conftest.py's
``pytest_plugins``.
"""

from __future__ import annotations

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

    from jagg_pipeline.config.fields import to_dict

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
