"""Training checkpoints on disk: the whole directory, written atomically, and the trainer state.

A round's checkpoint is the next round's ``--policy``::

    CKPT/manifest.json              stage "train" (written last; inputs: policy, rollouts, rewards)
    CKPT/config.yaml                the resolved config
    CKPT/policy/                    the weights (file format: :mod:`jagg_pipeline.policy`)
    CKPT/trainer/state.json         round, optimizer steps, skipped steps, LR-scheduler state,
                                    routing (with the probed cos-sims), world size
    CKPT/trainer/optimizer.safetensors   AdamW state keyed "state/<param>/<name>", the param
                                    groups (parameter names, hyper-parameters) in its metadata
    CKPT/trainer/rng.safetensors    the trainer's random generator (minibatch shuffles)
    CKPT/trainer/ema.safetensors    EMA of the trainable weights (names as the transformer's
                                    parameters), when ``train.ema_decay`` is set
    CKPT/metrics.jsonl              one flat line per optimizer step (artifacts.metrics_record)

Everything is written into ``.CKPT.partial`` beside the target and renamed into place at the
end, so nothing half-written ever appears under the final name, and a killed run's leftovers
are cleared by the rerun. Nothing non-finite is ever written. Knows nothing of FSDP: it takes
full (gathered) state dicts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from jagg_pipeline.artifacts import (
    METRICS_NAME,
    atomic_directory,
    atomic_write_text,
    metrics_record,
)
from jagg_pipeline.backbones import Backbone

STAGE = "train"
TRAINER_DIR = "trainer"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
EMA_FILE = "ema.safetensors"
_STATE_PREFIX = "state/"


class NonFiniteError(RuntimeError):
    """Training produced non-finite weights or optimizer state; no checkpoint is written."""


@dataclass
class TrainerState:
    """What the next round needs besides weights and tensors (``trainer/state.json``)."""

    round: int
    global_step: int
    skipped_steps: int
    scheduler: dict[str, Any]
    routing: dict[str, Any] | None = None
    world_size: int = 1


@dataclass
class CheckpointContents:
    """Everything a checkpoint holds, gathered in full (rank 0's view)."""

    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_state: torch.Tensor
    trainer: TrainerState
    metrics: list[dict[str, Any]] = field(default_factory=list)
    ema_state: dict[str, torch.Tensor] | None = None


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _flatten_optimizer(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """Optimizer state as named tensors plus JSON (param groups, non-tensor per-param values)."""
    tensors, scalars = {}, {}
    for param, values in state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_STATE_PREFIX}{param}/{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(param, {})[name] = value
    meta = {"param_groups": state["param_groups"], "scalars": scalars}
    return tensors, json.dumps(meta, sort_keys=True)


def _check_finite(contents: CheckpointContents) -> None:
    """Refuse to write if any weight or optimizer value is NaN or infinite."""
    groups = {
        "weights": contents.model_state,
        "EMA weights": contents.ema_state or {},
        "optimizer state": {
            f"{p}/{n}": v
            for p, values in contents.optimizer_state["state"].items()
            for n, v in values.items()
            if isinstance(v, torch.Tensor)
        },
    }
    for what, tensors in groups.items():
        bad = [
            name for name, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()
        ]
        if bad:
            raise NonFiniteError(
                f"non-finite {what} after training (e.g. {bad[:3]}); no checkpoint written "
                "(lower train.lr or check the rewards)"
            )


def write_checkpoint(
    target: str | Path,
    backbone: Backbone,
    contents: CheckpointContents,
    *,
    config: Any,
    seeds: Mapping[str, Any],
    inputs: Mapping[str, str | Path],
    extra: Mapping[str, Any],
) -> Path:
    """Write the checkpoint directory ``target`` atomically (see the module docstring).

    ``backbone`` supplies the policy format (LoRA adapters or full weights) and the names;
    the weights come from ``contents.model_state``. Raises :class:`NonFiniteError` (writing
    nothing) if any tensor is non-finite. An existing ``target`` is replaced.
    """
    from safetensors.torch import save_file

    from jagg_pipeline.manifest import finish_output
    from jagg_pipeline.policy import policy_weights_dir, write_policy_files

    _check_finite(contents)
    target = Path(target)
    with atomic_directory(target) as staging:
        trainer = staging / TRAINER_DIR
        trainer.mkdir()
        policy = policy_weights_dir(staging)
        policy.mkdir()
        write_policy_files(backbone, policy, contents.model_state)
        state = _json_safe(dataclasses.asdict(contents.trainer))
        atomic_write_text(trainer / STATE_FILE, json.dumps(state, indent=2) + "\n")
        tensors, meta = _flatten_optimizer(contents.optimizer_state)
        save_file(tensors, str(trainer / OPTIMIZER_FILE), metadata={"optimizer": meta})
        save_file({"trainer": contents.rng_state.cpu().contiguous()}, str(trainer / RNG_FILE))
        if contents.ema_state is not None:
            ema = {k: v.detach().cpu().contiguous() for k, v in contents.ema_state.items()}
            save_file(ema, str(trainer / EMA_FILE))
        records = (
            metrics_record(STAGE, row["round"], row["step"], _step_values(row))
            for row in contents.metrics
        )
        atomic_write_text(staging / METRICS_NAME, "".join(json.dumps(r) + "\n" for r in records))
        # config.yaml, then the manifest: the last file, the mark of a finished checkpoint.
        finish_output(staging, config, stage=STAGE, seeds=seeds, inputs=inputs, extra=extra)
    return target


def _step_values(row: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in row.items() if key not in ("round", "step")}


def _json_safe(value: Any) -> Any:
    """NaN and infinities as None (strict JSON has no spelling for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _trainer_file(checkpoint: str | Path, name: str) -> Path:
    path = Path(checkpoint) / TRAINER_DIR / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} missing: {checkpoint} is not a complete training checkpoint"
        )
    return path


def read_trainer_state(checkpoint: str | Path) -> TrainerState:
    """``trainer/state.json`` of a checkpoint."""
    path = _trainer_file(checkpoint, STATE_FILE)
    return TrainerState(**json.loads(path.read_text()))


def read_optimizer_state(checkpoint: str | Path) -> dict[str, Any]:
    """The full optimizer state dict (parameter names as keys) of a checkpoint."""
    from safetensors import safe_open

    path = _trainer_file(checkpoint, OPTIMIZER_FILE)
    with safe_open(str(path), "pt") as handle:
        meta = json.loads(handle.metadata()["optimizer"])
        state: dict[str, dict[str, Any]] = {
            param: dict(values) for param, values in meta["scalars"].items()
        }
        for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
            param, _, name = key.removeprefix(_STATE_PREFIX).rpartition("/")
            state.setdefault(param, {})[name] = handle.get_tensor(key)
    return {"state": state, "param_groups": meta["param_groups"]}


def read_rng_state(checkpoint: str | Path) -> torch.Tensor:
    """The trainer generator's state saved in a checkpoint."""
    from safetensors.torch import load_file

    return load_file(str(_trainer_file(checkpoint, RNG_FILE)))["trainer"]


def read_ema_state(checkpoint: str | Path) -> dict[str, torch.Tensor] | None:
    """The EMA weights of a checkpoint, or None if it was trained without EMA."""
    from safetensors.torch import load_file

    path = Path(checkpoint) / TRAINER_DIR / EMA_FILE
    return load_file(str(path)) if path.is_file() else None
