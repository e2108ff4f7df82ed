"""One whole discrete round, before and after, and what it projects to on an 8-GPU node.

Runs the stages of a round (encode, rollout, score, train) as the commands the workflow
starts, on the tiny real-format Flux pipeline
(:func:`jagg_pipeline.toyworld.tiny.save_tiny_pipeline`) whose transformer is replaced by a
``FluxTransformer2DModel`` of about ``--params`` parameters (random float32 weights,
``save_pretrained``), over 2 gloo ranks, for two source trees side by side: "after" (this
tree) and "before" (``--baseline DIR``, or a checkout of ``--baseline-rev REV`` made here
with ``git archive``). Each tree's commands run with its own package (``PYTHONPATH`` =
the tree, working directory the tree) and start as that tree's
workflow starts them: a stage whose rule uses the ranks' launcher runs under
``python -m torch.distributed.run --standalone --nproc_per_node 2``, any other as one
process; ``encode`` runs (once, before round 0) where the tree has the command, and its
folder goes to the rollout as ``--conditioning``. Round 0 starts from the base model, round 1
from round 0's checkpoint (the steady state: what every later round pays). The trees
alternate stage by stage (A B, then B A) so that both see the same machine load; each
checkpoint is deleted once no later stage needs it.

Every stage process (every rank) runs under a probe (``round_probe``, written to the work
folder and run with ``-m``): it calls the command as ``python -m jagg_pipeline`` does
(:func:`jagg_pipeline.support.startup.start_command`, :func:`jagg_pipeline.cli.main`) and
then writes its own seconds since the process start, ``/proc/self/io`` (``rchar``/``wchar``:
bytes read and written through system calls; ``read_bytes``: bytes brought in from the
disk, memory-mapped reads included), ``VmHWM`` and what it hashed by reading files: the
module-level hashing function of ``jagg_pipeline.io.manifest`` (``_hash_file`` where it
exists, else ``file_sha256``; both are called through the module's globals) is wrapped to
count each path's bytes and seconds, and ``manifest.hash_counts()`` is recorded where the
tree has it (the package's own count, bytes hashed while writing included). Before each
command the work folder and the model are synced and dropped from the page cache
(``posix_fadvise``), so ``read_bytes`` is what the stage reads from storage, once per node
(a rank reading what another already read finds it in the page cache). Each stage's
recorded ``time.import`` / ``time.load`` / ``time.work`` come from its metrics line.

The report (printed, and JSON at ``--out``): per tree, round and stage the wall seconds, the
recorded split, hashing seconds and GB, GB read and written, peak RSS per rank; each round's
totals and bytes hashed / bytes read; before and after side by side with their ratios. Then
the projection (:func:`project`): per round on one 8-GPU node, items 0-6 of issue 33 for
Flux.1-dev full fine-tuning (float32 and bf16), Flux.1-dev LoRA and QwenImage LoRA, from the
measured hashing pattern and rates and the assumptions listed in :data:`ASSUMPTIONS`.

    python benchmarks/round_overhead.py --baseline-rev HEAD --out results/bench/round_overhead.json
    python benchmarks/round_overhead.py --baseline-rev HEAD --params 2e7   # smoke run

Linux only (``/proc``). 0.5B float32 parameters with AdamW make a 6 GB checkpoint; at most
three are on disk at once (``--workdir``, default a temporary folder).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from _common import (
    GB,
    MODELS,
    choose_flux,
    count_parameters,
    drop_page_cache,
    gb,
    machine,
    table,
)
from scale_projection import preset_rows

HERE = Path(__file__).resolve().parent.parent
TESTS = HERE / "tests"
RANKS = 2
PROMPTS, GROUP = 2, 2  # a round: 2 prompts x 2 samples, one group per micro-batch and rank
STAGES = ("encode", "rollout", "score", "train")
PARTS = ("import", "load", "work")
# The tiny Flux pipeline's widths (toyworld.tiny._tiny_flux): packed 2 x 2 latents of its
# 4-channel VAE, its T5's 48 and its CLIP's 32 features. Flux's rope axes at head dim 128.
TINY_FLUX_DIMS = {
    "patch_size": 1,
    "in_channels": 16,
    "joint_attention_dim": 48,
    "pooled_projection_dim": 32,
    "axes_dims_rope": (16, 56, 56),
}
PROBE_MODULE = "round_probe"
PROBE = '''"""A stage process under measurement (benchmarks/round_overhead.py writes this file).

python -m round_probe OUT ARGV...: runs ``python -m jagg_pipeline ARGV`` as its __main__ does,
then writes OUT.rank<RANK>.json.
"""
import json
import os
import sys
import time

out, argv = sys.argv[1], sys.argv[2:]
from jagg_pipeline.support import startup  # noqa: E402

startup.start_command(argv)
from jagg_pipeline.io import manifest  # noqa: E402

hashed = {}  # path -> [times, bytes, seconds]
wrapped = "_hash_file" if hasattr(manifest, "_hash_file") else "file_sha256"
original = getattr(manifest, wrapped)


def counted(path, *args, **kwargs):
    start = time.perf_counter()
    digest = original(path, *args, **kwargs)
    entry = hashed.setdefault(os.path.abspath(path), [0, 0, 0.0])
    entry[0] += 1
    entry[1] += os.path.getsize(path)
    entry[2] += time.perf_counter() - start
    return digest


setattr(manifest, wrapped, counted)
from jagg_pipeline.cli import main  # noqa: E402

status = main(argv)


def age():
    with open("/proc/self/stat", "rb") as handle:
        ticks = int(handle.read().rsplit(b")", 1)[1].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


with open("/proc/self/io") as handle:
    io = {key: int(value) for key, value in (line.split(": ") for line in handle if line.strip())}
with open("/proc/self/status") as handle:
    hwm = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:"))
counts = manifest.hash_counts() if hasattr(manifest, "hash_counts") else None
if counts is not None:
    counts["read"].pop("paths", None)
record = {
    "rank": int(os.environ.get("RANK", "0")),
    "seconds": age(),
    "io": io,
    "hwm": hwm,
    "wrapped": wrapped,
    "hashed": hashed,
    "hash_counts": counts,
}
with open(f"{out}.rank{record['rank']}.json", "w") as handle:
    json.dump(record, handle)
startup.end_command()
raise SystemExit(status)
'''

# ------------------------------------------------------------------------------------------
# The model, the config, the trees
# ------------------------------------------------------------------------------------------


def build_model(params: float, root: Path) -> dict[str, Any]:
    """The tiny Flux pipeline under ``root`` with a ~``params``-parameter transformer."""
    import torch
    from diffusers import FluxTransformer2DModel

    from jagg_pipeline.toyworld.tiny import TINY_IMAGE_SIZE, save_tiny_pipeline

    kwargs = choose_flux(params)["kwargs"] | TINY_FLUX_DIMS
    pipeline = save_tiny_pipeline("flux", root / "flux")
    shutil.rmtree(pipeline / "transformer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        FluxTransformer2DModel(**kwargs).save_pretrained(pipeline / "transformer")
    size = TINY_IMAGE_SIZE
    return {
        "path": str(pipeline),
        "kwargs": {**kwargs, "axes_dims_rope": list(kwargs["axes_dims_rope"])},
        "parameters": count_parameters("FluxTransformer2DModel", kwargs),
        "transformer_bytes": folder_bytes(pipeline / "transformer"),
        "text_bytes": sum(folder_bytes(pipeline / n) for n in ("text_encoder", "text_encoder_2")),
        "pipeline_bytes": folder_bytes(pipeline),
        "images": PROMPTS * GROUP * 3 * size * size,  # a round's uint8 images
    }


def write_config(root: Path, pipeline: str) -> tuple[Path, Path]:
    """The tiny stage-test experiment made small (tests/stage_helpers.py); and its prompts."""
    sys.path.insert(0, str(TESTS))
    from stage_helpers import EVAL_PROMPTS, VARIED_PROMPTS, experiment, write_prompts

    prompts = write_prompts(root / "prompts.txt", VARIED_PROMPTS)
    evaluation = write_prompts(root / "eval_prompts.txt", EVAL_PROMPTS)
    data = experiment(
        "flux",
        Path(pipeline),
        evaluation,
        # 2 prompts x 2 samples in micro-batches of one group: one per rank; 4 steps, 2 trained.
        sampler={"prompts": str(prompts), "prompts_per_round": PROMPTS, "group_size": GROUP},
        train={"nproc": RANKS},
    )
    config = root / "experiment.yaml"
    config.write_text(yaml.safe_dump(data))
    return config, prompts


def baseline_tree(revision: str, workdir: Path) -> Path:
    """A checkout of ``revision`` (``git archive``, no state of this checkout changes)."""
    tree = workdir / f"baseline-{revision}"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(HERE), "archive", revision], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


@dataclass(frozen=True)
class Tree:
    """A source tree and how its workflow starts each stage."""

    name: str
    path: Path
    encode: bool  # has the encode command
    ranked: tuple[str, ...]  # stages started by the ranks' launcher (torchrun over train.nproc)


def tree_of(name: str, path: Path) -> Tree:
    """How ``path``'s own workflow rules start the stages (read from workflow/rules/*.smk)."""
    rules = path / "workflow" / "rules"
    ranked = tuple(
        stage
        for stage in STAGES
        if (rules / f"{stage}.smk").is_file()
        and "{params.launcher}" in (rules / f"{stage}.smk").read_text()
    )
    return Tree(name, path, (path / "jagg_pipeline" / "cli" / "encode.py").is_file(), ranked)


# ------------------------------------------------------------------------------------------
# Running and probing a stage
# ------------------------------------------------------------------------------------------


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 when it is gone)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def stage_argv(stage: str, config: Path, folders: dict[str, Any]) -> list[str]:
    """The command line of ``stage`` (as the tree's rules write it) for one round."""
    policy = folders["policy"]
    common = ["--config", str(config)]
    if stage == "encode":
        return ["encode", *common, "--prompts", str(folders["prompts"]), "--out", folders["out"]]
    if stage == "rollout":
        conditioning = (
            ["--conditioning", folders["conditioning"]] if folders["conditioning"] else []
        )
        return [
            "rollout",
            *common,
            "--policy",
            policy,
            "--round",
            str(folders["round"]),
            *conditioning,
            "--out",
            folders["out"],
        ]
    if stage == "score":
        return ["score", *common, "--rollouts", folders["rollouts"], "--out", folders["out"]]
    rollouts, scores = ["--rollouts", folders["rollouts"]], ["--scores", folders["scores"]]
    return ["train", *common, "--policy", policy, *rollouts, *scores, "--out", folders["out"]]


def recorded(folder: Path) -> dict[str, float]:
    """The ``time.*`` seconds of a stage folder's first metrics line that has them."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return {}
    for text in path.read_text().splitlines():
        line = json.loads(text)
        parts = {part: line[f"time.{part}"] for part in PARTS if f"time.{part}" in line}
        if parts:
            return parts
    return {}


class StageFailed(RuntimeError):
    """A stage command of one tree exited non-zero (the tree's later stages are skipped)."""


def errors(output: str) -> str:
    """A failed command's own error lines (the package's ``error:``), else its output's end."""
    lines = list(dict.fromkeys(x for x in output.splitlines() if x.startswith("error:")))
    return "\n".join(lines) if lines else output[-3000:]


def run_stage(
    tree: Tree, stage: str, argv: list[str], probe: Path, result: Path, drop: Sequence[Path]
) -> dict[str, Any]:
    """Run one stage command of ``tree`` under the probe; its wall seconds and rank records."""
    ranks = RANKS if stage in tree.ranked else 1
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    command = [*launcher, "-m", PROBE_MODULE, str(result), *argv]
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{tree.path}{os.pathsep}{probe}",
    }
    os.sync()  # dirty pages cannot be dropped
    for folder in drop:
        if folder.exists():
            drop_page_cache(folder)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=tree.path, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    log = result.with_suffix(".log")
    log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise StageFailed(
            f"{tree.name} ({tree.path}): {stage} failed (exit {done.returncode}): "
            f"{' '.join(command)}\n{errors(done.stdout + done.stderr)}"
        )
    records = [json.loads(Path(f"{result}.rank{r}.json").read_text()) for r in range(ranks)]
    return {"command": command, "ranks": ranks, "wall": wall, "processes": records}


def categorize(path: str, work: Path, round_index: int) -> str:
    """Which artifact a hashed file belongs to, relative to the stage's round.

    ``policy in`` / ``trainer in``: the checkpoint the round starts from; ``policy out`` /
    ``trainer out``: the one it writes (a ``.partial`` folder too); ``rollout``, ``scores``,
    ``conditioning``; ``other`` for anything else.
    """
    try:
        parts = Path(path).relative_to(work).parts
    except ValueError:
        return "other"
    if parts and parts[0] == "conditioning":
        return "conditioning"
    if len(parts) < 3 or not parts[0].startswith("round-"):
        return "other"
    artifact = parts[1].lstrip(".").removesuffix(".partial")
    if artifact == "checkpoint":
        which = "in" if int(parts[0].removeprefix("round-")) < round_index else "out"
        return f"{'policy' if parts[2] == 'policy' else 'trainer'} {which}"
    return artifact if artifact in ("rollout", "scores") else "other"


def summarize_stage(run: dict[str, Any], work: Path, round_index: int) -> dict[str, Any]:
    """A stage's totals over its processes, and its hashing by artifact and process."""
    processes = run["processes"]
    hashed: dict[str, list[float]] = {}  # category -> bytes per process
    for index, record in enumerate(processes):
        for path, (_, size, _) in record["hashed"].items():
            category = categorize(path, work, round_index)
            hashed.setdefault(category, [0.0] * len(processes))[index] += size
    io = [record["io"] for record in processes]
    counts = [record["hash_counts"] for record in processes]
    return {
        "ranks": run["ranks"],
        "wall": run["wall"],
        "process_seconds": [record["seconds"] for record in processes],
        "hash_bytes": sum(sum(b for _, b, _ in r["hashed"].values()) for r in processes),
        "hash_seconds_per_process": [sum(s for _, _, s in r["hashed"].values()) for r in processes],
        "hash_files": sum(sum(t for t, _, _ in r["hashed"].values()) for r in processes),
        "hash_by_artifact": hashed,
        "hashed_paths": [  # per process: path under the tree's folder -> bytes
            {os.path.relpath(path, work): size for path, (_, size, _) in r["hashed"].items()}
            for r in processes
        ],
        "package_hash_counts": counts if any(c is not None for c in counts) else None,
        "read_bytes": sum(i["read_bytes"] for i in io),
        "rchar": sum(i["rchar"] for i in io),
        "wchar": sum(i["wchar"] for i in io),
        "write_bytes": sum(i["write_bytes"] for i in io),
        "hwm": [record["hwm"] for record in processes],
    }


def measure(
    trees: list[Tree], model: dict[str, Any], config: Path, prompts: Path, work: Path
) -> dict[str, Any]:
    """Rounds 0 and 1 of every tree, stage by stage, the trees alternating."""
    probe = work / "probe"
    probe.mkdir()
    (probe / f"{PROBE_MODULE}.py").write_text(PROBE)
    results: dict[str, Any] = {tree.name: {"rounds": {}, "sizes": {}} for tree in trees}
    failed: dict[str, str] = {}
    steps = [(0, "encode")] + [(r, s) for r in (0, 1) for s in STAGES[1:]]
    for index, (round_index, stage) in enumerate(steps):
        order = trees if index % 2 == 0 else trees[::-1]
        for tree in order:
            if tree.name in failed or (stage == "encode" and not tree.encode):
                continue
            base = work / tree.name
            here = base / f"round-{round_index}"
            here.mkdir(parents=True, exist_ok=True)
            previous = base / f"round-{round_index - 1}" / "checkpoint"
            conditioning = base / "conditioning"
            folders = {
                "round": round_index,
                "prompts": prompts,
                "policy": "base" if round_index == 0 else str(previous),
                "conditioning": str(conditioning) if tree.encode else None,
                "rollouts": str(here / "rollout"),
                "scores": str(here / "scores"),
                "out": str(conditioning if stage == "encode" else here / FOLDERS[stage]),
            }
            argv = stage_argv(stage, config, folders)
            result = base / f"{stage}-{round_index}"
            print(
                f"[{time.strftime('%H:%M:%S')}] {tree.name} round {round_index} {stage}", flush=True
            )
            try:
                run = run_stage(tree, stage, argv, probe, result, [work, Path(model["path"])])
            except StageFailed as error:
                failed[tree.name] = str(error)
                print(error, flush=True)
                continue
            row = summarize_stage(run, base, round_index)
            row["recorded"] = recorded(Path(folders["out"]))
            row["argv"] = argv
            results[tree.name]["rounds"].setdefault(str(round_index), {})[stage] = row
            if stage == "train":
                sizes = results[tree.name]["sizes"].setdefault(str(round_index), {})
                sizes.update(artifact_sizes(here))
                if round_index == 1:  # round 0's checkpoint was round 1's policy
                    shutil.rmtree(previous, ignore_errors=True)
                    shutil.rmtree(here / "checkpoint", ignore_errors=True)
    for name, error in failed.items():
        results[name]["failed"] = error
    return results


FOLDERS = {"rollout": "rollout", "score": "scores", "train": "checkpoint"}


def artifact_sizes(round_folder: Path) -> dict[str, int]:
    """Bytes of a round's artifacts, by the categories hashing is counted in."""
    checkpoint = round_folder / "checkpoint"
    policy = folder_bytes(checkpoint / "policy")
    return {
        "policy": policy,
        "trainer": folder_bytes(checkpoint / "trainer"),
        "checkpoint": folder_bytes(checkpoint),
        "rollout": folder_bytes(round_folder / "rollout"),
        "scores": folder_bytes(round_folder / "scores"),
    }


# ------------------------------------------------------------------------------------------
# Hashing rates
# ------------------------------------------------------------------------------------------


def hash_rates(workdir: Path, size: int = 1 << 30) -> dict[str, float]:
    """Bytes per second hashing a ``size`` file from the page cache in 8 MiB reads.

    sha256 (hashlib, what the "before" manifests use), blake3 on one thread (a rank's share
    when all ranks of a node hash at once) and on every core here.
    """
    from blake3 import blake3

    path = workdir / "hash-probe.bin"
    chunk = os.urandom(64 << 20)
    with open(path, "wb") as handle:
        for _ in range(size // len(chunk)):
            handle.write(chunk)
    makers = {
        "sha256": hashlib.sha256,
        "blake3_1_thread": blake3,
        "blake3_all_cores": lambda: blake3(max_threads=blake3.AUTO),
    }
    block = memoryview(bytearray(8 << 20))
    rates = {"bytes": float(size), "cores": float(os.cpu_count() or 1)}
    for name, make in makers.items():
        best = math.inf
        for _ in range(2):  # the first pass also warms the page cache
            hasher, start = make(), time.perf_counter()
            with open(path, "rb") as handle:
                while count := handle.readinto(block):
                    hasher.update(block[:count])
            best = min(best, time.perf_counter() - start)
        rates[name] = size / best
    path.unlink()
    return rates


# ------------------------------------------------------------------------------------------
# Projection
# ------------------------------------------------------------------------------------------

NODE_RANKS = 8
# What the projection assumes, each with its source; every other input is measured here.
ASSUMPTIONS: dict[str, Any] = {
    "nvme_bytes_per_s": (3 * GB, 6 * GB),  # issue 33: NVMe at 3-6 GB/s, shared by the node
    "flux_text_encoder_bytes": 19.5 * GB,  # issue 33: T5-XXL + CLIP, loaded every round
    "qwen_text_encoder_bytes": 16.6 * GB,  # Qwen2.5-VL-7B, 8.29B parameters in bf16
    "idle_sampling_s": {"flux": 390.0, "qwenimage": 950.0},  # issue 33 (one GPU samples)
    # HPSv2.1's ViT-H-14 built before its weights load: issue 33's trace of create_model
    # (random init); built on the meta device, docs/reward-models.md (measured on 2 cores).
    "hpsv21_build_s": {"before": 14.6, "after": 0.3},
    "paper_step_s": {"flux": (279.0, 228.0), "qwenimage": (835.0, 691.0)},  # exact -> JAGG
    "issue_before_s": (550.0, 390.0),  # issue 33: about 550 s plus 390 s of idle GPUs
    "target_after_s": 120.0,  # issue 33: one discrete Flux full fine-tuning round
    "lora_moments_bytes_per_param": 12,  # float32 adapters and AdamW moments (peft upcasts)
}


@dataclass(frozen=True)
class Setting:
    """One projected training setting on one 8-GPU node."""

    name: str
    model: str  # a key of _common.MODELS
    family: str
    preset: str  # the preset whose sampler sets the rollout
    training: str  # full | lora
    itemsize: int  # bytes per weight and per moment (full fine-tuning)
    lora_rank: int | None = None


SETTINGS = (
    Setting("Flux.1-dev full FT float32", "Flux.1-dev", "flux", "flux-dancegrpo-hpsv21", "full", 4),
    Setting("Flux.1-dev full FT bf16", "Flux.1-dev", "flux", "flux-dancegrpo-hpsv21", "full", 2),
    Setting("Flux.1-dev LoRA r32", "Flux.1-dev", "flux", "flux-dancegrpo-hpsv21", "lora", 2, 32),
    Setting(
        "QwenImage LoRA r64", "QwenImage", "qwenimage", "qwenimage-hpsv21-pickscore", "lora", 2, 64
    ),
)


def lora_parameters(model: str, family: str, rank: int) -> int:
    """Adapter parameters of ``rank`` on the family's default targets (meta build)."""
    import diffusers
    import torch

    from jagg_pipeline.backbones import flux, qwenimage
    from jagg_pipeline.backbones.lora import target_modules

    backbone = {"flux": flux.FluxBackbone, "qwenimage": qwenimage.QwenImageBackbone}[family]
    cls_name, kwargs = MODELS[model]
    with torch.device("meta"):
        transformer = getattr(diffusers, cls_name)(**kwargs)
    layers = dict(transformer.named_modules())
    names = target_modules(transformer, backbone.default_lora_targets)
    return sum(rank * (layers[n].in_features + layers[n].out_features) for n in names)


def setting_sizes(setting: Setting, presets: Path) -> dict[str, float]:
    """Bytes of what a round of ``setting`` reads, writes and hashes, by artifact."""
    cls_name, kwargs = MODELS[setting.model]
    params = count_parameters(cls_name, kwargs)
    if setting.training == "full":
        policy = params * setting.itemsize
        trainer = 2 * params * setting.itemsize  # AdamW's moments in the weights' dtype
    else:
        adapters = lora_parameters(setting.model, setting.family, setting.lora_rank or 16)
        policy = adapters * 4
        trainer = adapters * (ASSUMPTIONS["lora_moments_bytes_per_param"] - 4)
    row = next(r for r in preset_rows(presets) if r["setting"] == setting.preset)
    sampler = yaml.safe_load((presets / f"{setting.preset}.yaml").read_text())["sampler"]
    height, width = (int(v) for v in row["size"].split("x"))
    text = ASSUMPTIONS[f"{'flux' if setting.family == 'flux' else 'qwen'}_text_encoder_bytes"]
    return {
        "parameters": params,
        "base": params * 2,  # the hub's bf16 weights on disk
        "base_in_dtype": params * setting.itemsize,
        "text_encoders": text,
        "policy": policy,
        "trainer": trainer,
        "checkpoint": policy + trainer,
        "rollout": row["rollout_reusable"],
        "images": row["samples_per_round"] * 3 * height * width,
        "micro_batches": row["samples_per_round"] / sampler["batch_size"],
    }


def artifact_bytes(sizes: dict[str, float]) -> dict[str, float]:
    """The hashed artifacts' bytes (:func:`categorize`'s names) from a round's sizes."""
    return {
        "policy in": sizes["policy"],
        "trainer in": sizes["trainer"],
        "policy out": sizes["policy"],
        "trainer out": sizes["trainer"],
        "rollout": sizes["rollout"],
    }


# What each stage writes: hashing it again reads it from the page cache, not from storage.
OUTPUTS = {
    "encode": ("conditioning",),
    "rollout": ("rollout",),
    "score": ("scores",),
    "train": ("policy out", "trainer out"),
}


def hash_pattern(stage: dict[str, Any], sizes: dict[str, float]) -> dict[str, Any]:
    """How a measured stage hashed each artifact (``sizes``: by :func:`categorize` name).

    Per artifact: ``bytes`` over all processes; ``times``: those bytes / the artifact's
    (None for one of no listed size: scores, conditioning); ``every_rank``: each of several
    processes hashed it whole; ``one_process``: one process hashed all of it.
    """
    artifacts = {}
    for category, per_process in stage["hash_by_artifact"].items():
        total, size = sum(per_process), sizes.get(category)
        artifacts[category] = {
            "bytes": total,
            "times": total / size if size else None,
            "every_rank": len(per_process) > 1 and bool(size) and min(per_process) >= size,
            "one_process": max(per_process) >= 0.999 * total,
        }
    return {"ranks": stage["ranks"], "artifacts": artifacts}


def projected_hashing(
    pattern: dict[str, Any], sizes: dict[str, float], rate: float
) -> tuple[float, float]:
    """(node bytes, critical-path seconds) of a stage's hashing on the node's 8 ranks.

    A stage measured as one process stays one. An artifact every rank hashed whole is hashed
    whole by each of the 8; one that one process hashed is hashed by one, the lead (rank 0
    after a save, say); one spread over the ranks (once per node) is split evenly. An
    artifact of no listed size keeps its measured bytes, on the lead.
    """
    ranks = NODE_RANKS if pattern["ranks"] > 1 else 1
    node = lead = each = 0.0
    for category, seen in pattern["artifacts"].items():
        if seen["times"] is None:
            node, lead = node + seen["bytes"], lead + seen["bytes"]
            continue
        size = sizes[category] * seen["times"]
        if ranks == 1 or seen["one_process"]:
            node, lead = node + size, lead + size
        elif seen["every_rank"]:
            share = size / pattern["ranks"]
            node, each = node + share * ranks, each + share
        else:
            node, each = node + size, each + size / ranks
    return node, (lead + each) / rate


def hashed_inputs(pattern: dict[str, Any], stage: str, sizes: dict[str, float]) -> float:
    """Bytes of a stage's inputs that its hashing reads from storage, once per node."""
    return sum(
        sizes[category] * min(seen["times"], 1.0)
        for category, seen in pattern["artifacts"].items()
        if seen["times"] is not None and category not in OUTPUTS[stage]
    )


def unhashed_reads(after: bool, stage: str, training: str, sizes: dict[str, float]) -> float:
    """Bytes a stage of round >= 1 reads from storage that no manifest check hashes.

    The base model has no manifest. Before: the rollout loads the base pipeline (transformer
    and text encoders) before it replaces the transformer with the checkpoint's; every
    train rank loads the base transformer (the node's page cache serves the other ranks).
    After: the text encoders are read once per run (encode); a LoRA policy's ranks read
    their chunks of the frozen base. The score stage reads the images (its check of the
    rollout, where it hashes the whole files, reads them first). :func:`storage_check`
    compares this plus :func:`hashed_inputs` with the reads measured at 0.5B.
    """
    if stage == "score":
        return 0.0
    if not after:
        return sizes["base"] + (sizes["text_encoders"] if stage == "rollout" else 0.0)
    return sizes["base"] if training == "lora" else 0.0


def project(
    patterns: dict[str, dict[str, Any]],
    startups: dict[str, float],
    written_hash: dict[str, bool],
    rates: dict[str, float],
    sizes: dict[str, float],
    setting: Setting,
) -> dict[str, Any]:
    """Per round on one 8-GPU node, items 0-6 of issue 33, before and after, in seconds.

    ``patterns``: per tree ("before", "after") and stage, :func:`hash_pattern` of the
    measured round 1; ``startups``: per tree the measured start-up seconds of a round's
    stages (imports and launcher); ``written_hash``: per tree whether its writers hash what
    they write; ``rates``: :func:`hash_rates`; ``sizes``: :func:`setting_sizes`. Every
    other input is in :data:`ASSUMPTIONS`. A stage's inputs take
    max(hashing, hashed bytes / NVMe) + unhashed bytes / NVMe: a check reads its files
    while it hashes them, and the loads that follow find them in the page cache. I/O items
    are (slow, fast) at the two NVMe rates. Item 6 (a device synchronise after every
    forward) needs a GPU and is not projected.
    """
    rates_io = ASSUMPTIONS["nvme_bytes_per_s"]
    idle = ASSUMPTIONS["idle_sampling_s"][setting.family]
    # One GPU samples every micro-batch while 7 wait (idle: 7/8 of its time); dealt
    # round-robin to 8 ranks, what is left idle is the dealing's imbalance.
    one_gpu = idle * NODE_RANKS / (NODE_RANKS - 1)
    batches = sizes["micro_batches"]
    imbalance = math.ceil(batches / NODE_RANKS) * NODE_RANKS / batches - 1
    artifacts = artifact_bytes(sizes)
    out: dict[str, Any] = {"setting": asdict(setting), "sizes": sizes, "items": {}}
    for tree in ("before", "after"):
        after = tree == "after"
        rate = rates["blake3_1_thread" if after else "sha256"]
        hashing, reads = {}, {}
        for stage, pattern in patterns[tree].items():
            node, critical = projected_hashing(pattern, artifacts, rate)
            hashed = hashed_inputs(pattern, stage, artifacts)
            other = unhashed_reads(after, stage, setting.training, sizes)
            hashing[stage] = (node, critical)
            # Storage time of the hashed inputs that their hashing does not hide, then the
            # rest, per NVMe rate.
            reads[stage] = [max(hashed / io - critical, 0.0) + other / io for io in rates_io]
        text = 0.0 if after else sizes["text_encoders"]
        text_s = tuple(text / io for io in rates_io)
        # Writers that hash: each rank its share of the checkpoint and of the rollout.
        written = (sizes["checkpoint"] + sizes["rollout"]) / NODE_RANKS / rate
        items = {
            "0 idle GPUs while sampling": (one_gpu / NODE_RANKS * imbalance if after else idle,),
            "1 hashing by reading": (sum(c for _, c in hashing.values()),),
            "1 hashing while writing": (written if written_hash[tree] else 0.0,),
            "2 rollout: policy and base reads": tuple(
                r - t for r, t in zip(reads["rollout"], text_s, strict=True)
            ),
            "2 rollout: text encoders": text_s,
            "3 train: checkpoint, base, rollout reads": tuple(reads["train"]),
            "4 reward model build (HPSv2.1)": (ASSUMPTIONS["hpsv21_build_s"][tree],),
            "5 rollout write, score reads": tuple(
                sizes["rollout"] / io + r for io, r in zip(rates_io, reads["score"], strict=True)
            ),
            "checkpoint write": tuple(sizes["checkpoint"] / io for io in rates_io),
            "start-ups (measured)": (startups[tree],),
        }
        overhead = tuple(
            sum(v[min(i, len(v) - 1)] for k, v in items.items() if not k.startswith("0"))
            for i in (0, 1)
        )
        idle_now = items["0 idle GPUs while sampling"][0]
        out["items"][tree] = {
            "seconds": items,
            "hashed_bytes": sum(n for n, _ in hashing.values()),
            "base_bytes_per_train_rank": sizes["base_in_dtype"] / (NODE_RANKS if after else 1),
            "overhead_s": overhead,
            "with_idle_s": tuple(t + idle_now for t in overhead),
        }
    out["paper_step_s"] = ASSUMPTIONS["paper_step_s"][setting.family]
    return out


def measured_sizes(results: dict[str, Any], tree: str, model: dict[str, Any]) -> dict[str, float]:
    """Round 1's artifacts in a measured tree, in :func:`setting_sizes`'s names."""
    round_1 = results[tree]["sizes"]["1"]
    return round_1 | {"base": model["transformer_bytes"], "text_encoders": model["text_bytes"]}


def round_1_artifacts(results: dict[str, Any], tree: str) -> dict[str, float]:
    """The hashed artifacts' bytes in a measured round 1 ("in": round 0's checkpoint)."""
    sizes = results[tree]["sizes"]
    return artifact_bytes(sizes["1"]) | {
        "policy in": sizes["0"]["policy"],
        "trainer in": sizes["0"]["trainer"],
    }


def projection_inputs(results: dict[str, Any]) -> dict[str, Any]:
    """From each tree's measured round 1: hashing patterns, start-ups, hashing writers."""
    patterns, startups, written = {}, {}, {}
    for tree in ("before", "after"):
        stages = results[tree]["rounds"]["1"]
        named = round_1_artifacts(results, tree)
        patterns[tree] = {stage: hash_pattern(row, named) for stage, row in stages.items()}
        # Start-up: the processes' imports (rank 0's record) and the launcher's own seconds.
        startups[tree] = sum(
            row["recorded"].get("import", 0.0) + max(row["wall"] - max(row["process_seconds"]), 0.0)
            for row in stages.values()
        )
        written[tree] = any(
            counts["written"]["bytes"] > 0
            for row in stages.values()
            for counts in (row["package_hash_counts"] or [])
            if counts is not None
        )
    return {"patterns": patterns, "startups": startups, "written_hash": written}


def storage_check(
    results: dict[str, Any], model: dict[str, Any], patterns: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """The projection's storage reads at the measured sizes beside each round-1 stage's."""
    rows = []
    for tree in ("before", "after"):
        sizes, named = measured_sizes(results, tree, model), round_1_artifacts(results, tree)
        for stage, row in results[tree]["rounds"]["1"].items():
            predicted = hashed_inputs(patterns[tree][stage], stage, named)
            predicted += unhashed_reads(tree == "after", stage, "full", sizes)
            rows.append(
                {"tree": tree, "stage": stage, "model": predicted, "measured": row["read_bytes"]}
            )
    return rows


# ------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------


def seconds(value: float | None) -> str:
    """Seconds with one decimal ("-": none)."""
    return "-" if value is None else f"{value:.1f}"


def stage_cells(row: dict[str, Any] | None) -> list[str]:
    """wall, import, load, work, hash s, hash GB, read GB, written GB, peak RSS GB per rank."""
    if row is None:
        return ["-"] * 9
    parts = [seconds(row["recorded"].get(part)) for part in PARTS]
    return [
        seconds(row["wall"]),
        *parts,
        seconds(max(row["hash_seconds_per_process"])),
        gb(row["hash_bytes"]),
        gb(row["read_bytes"]),
        gb(row["write_bytes"]),
        "/".join(gb(h) for h in row["hwm"]),
    ]


def round_totals(stages: dict[str, Any]) -> dict[str, float]:
    """A round's wall, hashing and bytes over its stages."""
    totals = {
        key: sum(row[key] for row in stages.values())
        for key in ("wall", "hash_bytes", "read_bytes", "write_bytes")
    }
    totals["hash_seconds"] = sum(max(row["hash_seconds_per_process"]) for row in stages.values())
    totals["hashed_per_read"] = totals["hash_bytes"] / max(totals["read_bytes"], 1)
    return totals


def print_measured(results: dict[str, Any], names: Sequence[str]) -> None:
    """Per tree, round and stage; then the rounds' totals side by side."""
    headers = ["tree", "round", "stage", "ranks", "wall s", "import s", "load s", "work s"]
    headers += ["hash s", "hash GB", "read GB", "written GB", "peak RSS GB/rank"]
    rows = []
    for name in names:
        for round_index, stages in results[name]["rounds"].items():
            for stage in STAGES:
                if stage in stages:
                    row = stages[stage]
                    rows.append([name, round_index, stage, row["ranks"], *stage_cells(row)])
    print(table(headers, rows))
    print(
        "(read / written GB: to and from storage (/proc/self/io read_bytes, write_bytes), the"
        " page cache dropped before each stage)"
    )
    headers = ["round", "quantity", *names]
    headers += ["after / before"] if len(names) == 2 else []
    rows = []
    for round_index in ("0", "1"):
        done = [results[n]["rounds"].get(round_index) for n in names]
        totals = [None if stages is None else round_totals(stages) for stages in done]
        for key, label, show in (
            ("wall", "wall s", seconds),
            ("hash_seconds", "hashing s", seconds),
            ("hash_bytes", "hashed GB", gb),
            ("read_bytes", "read GB (storage)", gb),
            ("write_bytes", "written GB (storage)", gb),
            ("hashed_per_read", "hashed / read", lambda v: f"{v:.2f}"),
        ):
            values = [None if t is None else t[key] for t in totals]
            cells = ["-" if v is None else show(v) for v in values]
            if len(names) == 2 and None not in values and values[0]:
                cells.append(f"{values[1] / values[0]:.2f}x")
            elif len(names) == 2:
                cells.append("-")
            rows.append([round_index, label, *cells])
    print("\nRound totals (stages in sequence; round 0 includes the encode stage)")
    print(table(headers, rows))


def spread(values: Sequence[float]) -> str:
    """Seconds as ``12`` or, at the two NVMe rates, ``24-12``."""
    return "-".join(dict.fromkeys(f"{v:.0f}" for v in values))


def print_projection(projections: list[dict[str, Any]]) -> None:
    """The items per setting, before and after, with the paper's step times."""
    for projection in projections:
        before, after = projection["items"]["before"], projection["items"]["after"]
        sizes = projection["sizes"]
        print(
            f"\n{projection['setting']['name']}: checkpoint {gb(sizes['checkpoint'])} GB, "
            f"rollout {gb(sizes['rollout'])} GB, base {gb(sizes['base'])} GB (bf16)"
        )
        rows = [
            [item, spread(values), spread(after["seconds"][item])]
            for item, values in before["seconds"].items()
        ]
        rows += [
            [
                "overhead (items 1-5 and the rest)",
                spread(before["overhead_s"]),
                spread(after["overhead_s"]),
            ],
            [
                "with the idle GPUs (item 0)",
                spread(before["with_idle_s"]),
                spread(after["with_idle_s"]),
            ],
            ["GB hashed by reading", gb(before["hashed_bytes"]), gb(after["hashed_bytes"])],
            [
                "GB of base transformer per train rank",
                gb(before["base_bytes_per_train_rank"]),
                gb(after["base_bytes_per_train_rank"]),
            ],
            [
                "paper step s (exact -> JAGG)",
                "{:.0f} -> {:.0f}".format(*projection["paper_step_s"]),
                "",
            ],
        ]
        print(table(["s per round, one 8-GPU node (I/O at 3-6 GB/s)", "before", "after"], rows))


def print_storage_check(rows: list[dict[str, Any]]) -> None:
    """The projection's storage model at the measured sizes beside the measured reads."""
    print("\nStorage reads of round 1: the projection's model at the measured sizes vs measured")
    lines = [[r["tree"], r["stage"], gb(r["model"]), gb(r["measured"])] for r in rows]
    print(table(["tree", "stage", "model GB", "measured GB"], lines))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=5e8, help="transformer parameters")
    parser.add_argument("--baseline", type=Path, help="the 'before' source tree")
    parser.add_argument("--baseline-rev", help="make the 'before' tree: git archive REV")
    parser.add_argument("--tree", type=Path, default=HERE, help="the 'after' tree (this one)")
    parser.add_argument("--workdir", type=Path, help="where rounds go (default: a temp dir)")
    parser.add_argument("--presets", type=Path, default=HERE / "presets")
    parser.add_argument("--out", type=Path, help="JSON file of the measurements")
    parser.add_argument(
        "--from-json", type=Path, help="report and project a finished run's --out file again"
    )
    args = parser.parse_args(argv)
    if args.from_json is None and (args.baseline is None) == (args.baseline_rev is None):
        parser.error("give exactly one of --baseline DIR and --baseline-rev REV")
    return args


def run_both(args: argparse.Namespace) -> tuple[dict, dict, dict, dict]:
    """Build the model, measure both trees' rounds and the hashing rates; then clean up."""
    work = Path(tempfile.mkdtemp(prefix="round-overhead-", dir=args.workdir)).resolve()
    try:
        base = args.baseline.resolve() if args.baseline else baseline_tree(args.baseline_rev, work)
        trees = [tree_of("before", base), tree_of("after", args.tree.resolve())]
        model = build_model(args.params, work)
        print(
            f"model: FluxTransformer2DModel {model['kwargs']}: {model['parameters']:,} "
            f"parameters (target {args.params:,.0f}), {gb(model['transformer_bytes'])} GB",
            flush=True,
        )
        for tree in trees:
            print(f"{tree.name}: {tree.path}, encode {tree.encode}, ranked {tree.ranked}")
        config, prompts = write_config(work, model["path"])
        results = measure(trees, model, config, prompts, work)
        rates = hash_rates(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    described = {
        t.name: {"path": str(t.path), "encode": t.encode, "ranked": t.ranked} for t in trees
    }
    return model, described, results, rates


def main(argv: Sequence[str] | None = None) -> None:
    """Measure both trees' rounds, project, print the tables and write the JSON."""
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.from_json:
        record = json.loads(args.from_json.read_text())
    else:
        record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine()}
        record.update(zip(("model", "trees", "results", "hash_rates"), run_both(args), strict=True))
    model, results, rates = record["model"], record["results"], record["hash_rates"]
    names = list(results)
    print()
    print_measured(results, names)
    rate_text = ", ".join(
        f"{k} {v / GB:.2f} GB/s" for k, v in rates.items() if k.startswith(("sha", "bl"))
    )
    print(f"\nhashing a 1 GiB file from the page cache: {rate_text}")
    projections, check = None, None
    complete = all(
        results[n]["rounds"].get("1", {}).keys() >= {"rollout", "score", "train"} for n in names
    )
    if complete:
        inputs = projection_inputs(results)
        projections = [
            project(**inputs, rates=rates, sizes=setting_sizes(s, args.presets), setting=s)
            for s in SETTINGS
        ]
        check = storage_check(results, model, inputs["patterns"])
        print_storage_check(check)
        print_projection(projections)
    for name in names:
        if "failed" in results[name]:
            print(f"\n{name} FAILED:\n{results[name]['failed']}")
    record |= {"assumptions": ASSUMPTIONS, "projection": projections, "storage_check": check}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
