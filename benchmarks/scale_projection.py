"""Scale projection: rollout bytes per sample, and what training at scale costs in disk and RAM.

Three parts, printed as tables and written as one JSON file (``--out``):

1. **Rollout bytes per sample** under three ways of storing velocities: at every trained step
   in float32 (``every_trained_f32``), at every trained step in the compute dtype
   (``every_trained``), and only at the steps the on-policy step can reuse
   (``reusable``: :func:`jagg_pipeline.stages.rollout.velocity_steps`, in
   :func:`~jagg_pipeline.stages.rollout.compute_dtype`, what the rollout stage stores). For the
   toy world's default config (measured on real rollouts of the toy SD3 pipeline with random
   weights, checked against the count from shapes), for :data:`PROJECTION_SETTING` (counted
   from its shapes) and for the project's presets as written (``--presets``, loaded through the
   config loader).

2. **sha256 throughput** of the stage manifests' hashing, on a 1 GiB file, cached and uncached.

3. **Projection** to Flux.1-dev, QwenImage and SD3.5-medium at :data:`PROJECTION_SETTING`,
   full fine-tuning with AdamW: checkpoint bytes per round, host RAM while saving (gathered vs
   sharded, scaled by the overheads ``scale_rehearsal.py`` measured, from ``--rehearsal``),
   disk for the run's rounds (all kept vs ``workflow.keep_every``), rollout disk per round, the
   base model every rank loads, and the sha256 time of the stage manifests' input checks.

    python benchmarks/scale_projection.py --rehearsal results/bench/scale_rehearsal.json \
        --out results/bench/scale_projection.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    FAMILY_MODELS,
    GB,
    MODELS,
    SAVE_TARGET,
    base_config_data,
    config_with,
    count_parameters,
    drop_page_cache,
    gb,
    machine,
    mb,
    table,
)

# The velocity-storing settings compared, as overrides of the config they apply to.
ROLLOUT_SETTINGS: dict[str, list[str]] = {
    "exact": ["jagg.mode=exact"],
    "jagg W=4 f=1": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=1.0"],
    "jagg W=4 f=0.5": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=0.5"],
    "jagg W=2 f=1": ["jagg.mode=jagg", "jagg.window=2", "jagg.jagg_frac=1.0"],
    "no_interp drop W=4": ["jagg.mode=no_interp", "jagg.no_interp=drop", "jagg.window=4"],
    "no_interp nearest W=4": ["jagg.mode=no_interp", "jagg.no_interp=nearest", "jagg.window=4"],
    "jagg W=4 f=auto": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=auto"],
}
# The projection's rollouts per round: these settings, velocities stored where reusable.
PROJECTED_ROLLOUTS = {"exact": "exact", "jagg f=0.5": "jagg W=4 f=0.5", "jagg f=1": "jagg W=4 f=1"}

# A setting of this benchmark, not a preset (presets/flux-dancegrpo-hpsv21.yaml is DanceGRPO's:
# 720 px, 16 steps, 9 trained, 16 prompts x 12 a round; its figures are in the presets table).
PROJECTION_SETTING_LABEL = (
    "the projection's setting, not a preset: Flux.1-dev in bf16 at FluxPipeline's default "
    "1024 px and 28 steps (diffusers), all SDE, 16 trained, 64 prompts x 16 samples a round, "
    "8 ranks, 300 rounds (this benchmark's choices)"
)
PROJECTION_SETTING = [
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
# Each family at the setting's sampler, with its own latents and text.
PROJECTION_BACKBONES: dict[str, list[str]] = {
    "Flux.1-dev": [],
    "QwenImage": ["backbone.family=qwenimage", "backbone.max_sequence_length=null"],
    "SD3.5-medium": ["backbone.family=sd3", "backbone.max_sequence_length=null"],
}
KEEP_EVERY = 50  # the projection's workflow.keep_every
BYTES_PER_PARAM = {"bf16": 6, "fp32": 12, "ema_bf16": 2}  # weights + 2 AdamW moments; EMA copy
QWEN_PROMPT_TOKENS = 128  # QwenImage pads text to the round's longest prompt: assumed

# ------------------------------------------------------------------------------------------
# Rollout bytes per sample
# ------------------------------------------------------------------------------------------


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


def velocity_row(config: Any, layout: SampleLayout, name: str) -> dict[str, Any]:
    """Bytes per sample of one setting, by how velocities are stored (steps from the stage)."""
    from jagg_pipeline.stages.rollout import compute_dtype, derive_seed, step_masks, velocity_steps

    masks = step_masks(config.sampler, derive_seed(config.train.seed, "steps", 0))
    trained = masks.trained_indices
    stored = velocity_steps(config, trained)
    dtype = _dtype_name(compute_dtype(config.backbone))
    rest = layout.bytes_without_velocities()
    return {
        "setting": name,
        "trained_steps": len(trained),
        "reusable_steps": len(stored),
        "velocity_dtype": dtype,
        "every_trained_f32": rest + len(trained) * layout.velocity_bytes("float32"),
        # As the network returns it: the compute dtype (bfloat16 for a bf16 or
        # mixed-precision policy).
        "every_trained": rest + len(trained) * layout.velocity_bytes(dtype),
        "reusable": rest + len(stored) * layout.velocity_bytes(dtype),
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
        row = velocity_row(config, layout, name)
        row["file_bytes_per_sample"] = path.stat().st_size / len(batch)
        row["stored_velocity_steps"] = batch.velocity_steps or []
        assert len(row["stored_velocity_steps"]) == row["reusable_steps"], row
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


def setting_rollouts(base: dict[str, Any], setting: Sequence[str]) -> dict[str, Any]:
    """Bytes per sample of each of :data:`ROLLOUT_SETTINGS` on ``setting``, from its shapes."""
    layout = layout_for(config_with(base, setting))
    rows = [
        velocity_row(config_with(base, [*setting, *overrides]), layout, name)
        for name, overrides in ROLLOUT_SETTINGS.items()
    ]
    return {"overrides": list(setting), "layout": dataclasses.asdict(layout), "rows": rows}


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
    file_sha256(path)  # as the stage manifests hash a file
    results["cached_bytes_per_s"] = size / (time.perf_counter() - start)
    drop_page_cache(workdir)
    start = time.perf_counter()
    file_sha256(path)
    results["disk_bytes_per_s"] = size / (time.perf_counter() - start)
    path.unlink()
    return results


# ------------------------------------------------------------------------------------------
# Kept rounds, presets, projection
# ------------------------------------------------------------------------------------------


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


def preset_rows(folder: Path) -> list[dict[str, Any]]:
    """The project's presets as written: rollout bytes, checkpoint, kept rounds."""
    from jagg_pipeline.config.yaml_io import read_yaml
    from jagg_pipeline.workflow.sections import split

    rows = []
    for path in sorted(folder.glob("*.yaml")):
        base, workflow = split(read_yaml(path))
        config = config_with(base, [])
        row = velocity_row(config, layout_for(config), path.stem)
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
            "rollout_every_trained": samples * row["every_trained"],
            "rollout_reusable": samples * row["reusable"],
            "checkpoint": checkpoint,
            "keep_own": keep_plan(config, workflow.keep_every),
            "keep_50": keep_plan(config, KEEP_EVERY),
        }
        rows.append(row)
    return rows


def project(
    rehearsal_overheads: dict[str, float] | None, sha: dict[str, float], config_file: Path
) -> dict[str, Any]:
    """Per model at :data:`PROJECTION_SETTING`: checkpoint, host RAM, disk, base load, sha256."""
    base = base_config_data(config_file)
    setting = config_with(base, PROJECTION_SETTING)
    plans = {
        every: keep_plan(
            config_with(base, [*PROJECTION_SETTING, f"eval.every={every}"]), KEEP_EVERY
        )
        for every in (KEEP_EVERY, 10)
    }
    most = plans[KEEP_EVERY]["most_on_disk"]
    ranks, rounds = setting.train.nproc, setting.train.rounds
    samples = setting.sampler.prompts_per_round * setting.sampler.group_size
    speed = sha["cached_bytes_per_s"]
    rows = []
    for name, (cls_name, kwargs) in MODELS.items():
        params = count_parameters(cls_name, kwargs)
        checkpoint = params * BYTES_PER_PARAM["bf16"]
        shard = checkpoint / ranks
        per_sample = setting_rollouts(base, [*PROJECTION_SETTING, *PROJECTION_BACKBONES[name]])
        by_setting = {row["setting"]: row for row in per_sample["rows"]}
        jagg_f1 = by_setting[PROJECTED_ROLLOUTS["jagg f=1"]]
        rollout = {
            "every_trained_f32": samples * jagg_f1["every_trained_f32"],
            "every_trained": samples * jagg_f1["every_trained"],
            **{key: samples * by_setting[s]["reusable"] for key, s in PROJECTED_ROLLOUTS.items()},
        }
        # The manifests' input checks, per process and round: every rollout rank hashes the
        # policy checkpoint; every train rank the checkpoint and the whole rollout.
        rollout_rank = checkpoint / speed
        train_rank = (checkpoint + rollout["jagg f=1"]) / speed
        row: dict[str, Any] = {
            "model": name,
            "parameters": params,
            "checkpoint_bf16": checkpoint,
            "checkpoint_bf16_ema": checkpoint + params * BYTES_PER_PARAM["ema_bf16"],
            "checkpoint_fp32": params * BYTES_PER_PARAM["fp32"],
            "shard_bf16": shard,
            "checkpoints_all": rounds * checkpoint,
            "checkpoints_keep": most * checkpoint,
            "rollout_per_round": rollout,
            "rollouts_all": rounds * rollout["jagg f=1"],
            "rollouts_keep": most * rollout["jagg f=1"],
            "base_load_per_rank": params * 2,
            "base_load_per_node": params * 2 * ranks,
            "sha256_s_rollout_rank": rollout_rank,
            "sha256_s_train_rank": train_rank,
            "sha256_hours_all_rounds": rounds * (rollout_rank + train_rank) / 3600,
            "sha256_bytes_per_node_round": ranks * (2 * checkpoint + rollout["jagg f=1"]),
        }
        if rehearsal_overheads is not None:
            gathered = rehearsal_overheads["gathered_rank0_per_checkpoint_byte"]
            sharded = rehearsal_overheads["sharded_per_shard_byte"]
            row["save_ram_gathered_rank0"] = gathered * checkpoint
            row["save_ram_sharded_per_rank"] = sharded * shard
            row["save_ram_limit_per_rank"] = SAVE_TARGET[0] * shard + SAVE_TARGET[1]
        rows.append(row)
    return {
        "setting": PROJECTION_SETTING_LABEL,
        "assumptions": {
            "overrides": PROJECTION_SETTING,
            "ranks": ranks,
            "bytes_per_param": BYTES_PER_PARAM,
            "rounds": rounds,
            "keep_every": KEEP_EVERY,
            "samples_per_round": samples,
            "sha256_bytes_per_s": speed,
        },
        "disk_plans": plans,
        "rows": rows,
    }


# ------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------


def print_rollouts(
    name: str, result: dict[str, Any], measured: bool, unit: tuple[str, float] = ("MB", 1e6)
) -> None:
    """Bytes per sample per setting, by how velocities are stored, in ``unit`` (name, bytes)."""
    label, size = unit

    def show(value: float) -> str:
        return f"{value / size:.2f}"

    print(f"\nRollout bytes per sample: {name}")
    headers = ["setting", "trained", "reusable", "dtype", f"every trained f32 {label}"]
    headers += [f"every trained {label}", f"reusable {label}", "reusable / every trained f32"]
    if measured:
        headers.append(f"file {label} / sample")
    rows = []
    for row in result["rows"]:
        line = [
            row["setting"],
            row["trained_steps"],
            row["reusable_steps"],
            row["velocity_dtype"],
            show(row["every_trained_f32"]),
            show(row["every_trained"]),
            show(row["reusable"]),
            f"{row['reusable'] / row['every_trained_f32']:.2f}",
        ]
        if measured:
            line.append(show(row["file_bytes_per_sample"]))
        rows.append(line)
    print(table(headers, rows))


def print_presets(rows: Sequence[dict[str, Any]]) -> None:
    """The presets' rollouts and checkpoints, as configured."""
    print("\nThe project's presets as written (rollout from their shapes)")
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
                f"{row['reusable_steps']} {row['velocity_dtype']}",
                mb(row["every_trained"]),
                mb(row["reusable"]),
                row["samples_per_round"],
                gb(row["rollout_every_trained"]),
                gb(row["rollout_reusable"]),
                "LoRA" if row["checkpoint"] is None else gb(row["checkpoint"]),
                f"{own['keep_every']}: {len(own['kept'])}/{own['most_on_disk']}",
                f"{len(fifty['kept'])}/{fifty['most_on_disk']} (eval {fifty['eval_every']})",
            ]
        )
    headers = ["preset", "px", "dtype/mp", "steps", "trained", "reusable", "MB every trained"]
    headers += ["MB reusable", "samples", "GB/round every trained", "reusable", "ckpt GB"]
    headers += ["keep_every: kept/most", f"keep {KEEP_EVERY}: kept/most"]
    print(table(headers, lines))


def print_checkpoints(projection: dict[str, Any]) -> None:
    """The projection's checkpoint sizes and host RAM while saving, per model."""
    print(
        f"\nProjection at {projection['setting']}: full fine-tuning, AdamW, bf16 weights and "
        "moments (6 B/param; EMA +2 B/param; fp32 12 B/param)"
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


def print_disk(projection: dict[str, Any]) -> None:
    """The projection's kept rounds and the disk its checkpoints and rollouts take."""
    plans = projection["disk_plans"]
    most = plans[KEEP_EVERY]["most_on_disk"]
    rounds = projection["assumptions"]["rounds"]
    verdict = "met" if most <= 7 else "NOT met"
    print(
        f"\n{rounds} rounds, keep_every {KEEP_EVERY} (eval.every {KEEP_EVERY}): kept rounds "
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
                gb(row["checkpoints_all"]),
                gb(row["checkpoints_keep"]),
                *(gb(rollout[key]) for key in ("every_trained_f32", "every_trained")),
                *(gb(rollout[key]) for key in PROJECTED_ROLLOUTS),
                gb(row["rollouts_all"]),
                gb(row["rollouts_keep"]),
            ]
        )
    headers = ["model", f"ckpts all {rounds}", f"ckpts keep {KEEP_EVERY}"]
    headers += ["rollout/round every trained f32", "every trained bf16"]
    headers += [f"reusable {key}" for key in PROJECTED_ROLLOUTS]
    headers += [f"rollouts all {rounds}", f"rollouts keep {KEEP_EVERY}"]
    samples = projection["assumptions"]["samples_per_round"]
    print(f"Disk, GB ({samples} samples a round; rollouts 'all' / 'keep' at reusable jagg f=1)")
    print(table(headers, rows))


def print_per_rank(projection: dict[str, Any], sha: dict[str, float]) -> None:
    """What the projection still loads and hashes in proportion to the whole model, per rank."""
    ranks, rounds = projection["assumptions"]["ranks"], projection["assumptions"]["rounds"]
    rows = [
        [
            row["model"],
            gb(row["base_load_per_rank"]),
            gb(row["base_load_per_node"]),
            f"{row['sha256_s_rollout_rank']:.0f}",
            f"{row['sha256_s_train_rank']:.0f}",
            gb(row["sha256_bytes_per_node_round"]),
            f"{row['sha256_hours_all_rounds']:.1f}",
        ]
        for row in projection["rows"]
    ]
    headers = ["model", "base load GB/rank", f"GB/node ({ranks} ranks)", "sha256 s/rollout rank"]
    headers += ["s/train rank", "GB hashed/node/round", f"h per {rounds} rounds"]
    print("\nWhat still scales with the whole model per rank")
    print(table(headers, rows))
    print(
        f"sha256 here: {sha['cached_bytes_per_s'] / GB:.2f} GB/s from the page cache, "
        f"{sha['disk_bytes_per_s'] / GB:.2f} GB/s after dropping the file from it (one core, "
        "1 MiB reads, as the manifests hash)"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the figures")
    parser.add_argument(
        "--config", type=Path, default=Path("config.yaml"), help="the workflow config file"
    )
    parser.add_argument("--presets", type=Path, default=Path("presets"), help="the presets folder")
    parser.add_argument(
        "--rehearsal",
        type=Path,
        default=None,
        help="scale_rehearsal.py's JSON: its measured overheads size the host RAM while saving",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where rollouts go (default: a temp dir)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Count, measure, project; print the tables and write the JSON."""
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    overheads = None
    if args.rehearsal is not None:
        overheads = json.loads(args.rehearsal.read_text())["overheads"]
    workdir = Path(tempfile.mkdtemp(prefix="scale-projection-", dir=args.workdir))
    try:
        toy = toy_rollouts(args.config, workdir)
        sha = sha256_throughput(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    setting = setting_rollouts(base_config_data(args.config), PROJECTION_SETTING)
    presets = preset_rows(args.presets)
    projection = project(overheads, sha, args.config)
    print_rollouts(f"toy world default config ({args.config}), measured", toy, True, ("kB", 1e3))
    print_rollouts(PROJECTION_SETTING_LABEL, setting, False)
    print_presets(presets)
    print_checkpoints(projection)
    print_disk(projection)
    print_per_rank(projection, sha)
    if args.out:
        record = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine(),
            "rehearsal": None if args.rehearsal is None else str(args.rehearsal),
            "overheads": overheads,
            "rollout_toy": toy,
            "rollout_setting": setting,
            "presets": presets,
            "sha256": sha,
            "projection": projection,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
