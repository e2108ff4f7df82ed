"""Per-round overhead of single-round jobs (K = 1) vs blocks of K rounds in one job.

A GRPO round (rollout -> score -> train) runs either as the workflow's single-round jobs
(``rollout``, ``score``, ``train``: one process group each, every job paying its process
start, imports, model loads and a checkpoint write + read) or, with
``workflow.rounds_per_job`` K > 1, inside a ``block`` job that runs K rounds in one process
group with the models resident (``jagg_pipeline.stages.block``). This benchmark measures both,
side by side in one run, on the model of ``benchmarks/round_overhead.py``: the tiny
real-format Flux pipeline with a ``FluxTransformer2DModel`` of about ``--params`` parameters
(:func:`round_overhead.build_model`, random float32 weights, AdamW) and its config
(:func:`round_overhead.write_config`: 2 prompts x 2 samples, 4 steps of which 2 trained,
``train.nproc`` 2), over 2 gloo ranks. The prompt pool is encoded once (``encode``) and every
mode samples from it (``--conditioning``).

Modes (each from the base policy, in its own run folder, one after the other):

- **K = 1**: rounds 0 .. R-1 as :mod:`round_overhead` runs them
  (:func:`round_overhead.stage_argv`, :func:`round_overhead.run_stage`): ``rollout`` and
  ``train`` under ``python -m torch.distributed.run --standalone --nproc_per_node 2``,
  ``score`` as one process; each round's checkpoint is the next round's ``--policy`` and is
  deleted once that round has trained.
- **K = 4, K = 25**: ``python -m torch.distributed.run ... -m jagg_pipeline block --rounds
  FIRST LAST`` for each block of K consecutive rounds (R a multiple of K), keeping nothing but
  the block's last checkpoint (``--checkpoint``), which is the next block's ``--policy``.

Every job (every rank) runs under round_overhead's probe (``round_probe``: the command as
``python -m jagg_pipeline`` runs it, then the process's seconds since its start,
``/proc/self/io``, ``VmHWM``), and the work folder and the model are synced and dropped from
the page cache before each job, as in round_overhead: each job reads what it loads from
storage.

Definitions, the same for both modes. A job's **wall** is the launcher's (``torchrun`` or the
one process) from start to exit. The **work** of a round is what its metric lines record of
sampling, scoring and training: the rollout line's ``seconds`` (sampling, rank 0), the score
line's ``time.work`` (scoring) and, over the train lines (one per optimizer step), the sum of
``time.forward + time.backward + time.optimizer``. Single-round jobs write the lines in their
output folders (``rollout/``, ``scores/``, ``checkpoint/metrics.jsonl``), a block in
``round-<r>/metrics/{rollout,score,train}.jsonl``. **Overhead per round** = (sum of the
jobs' wall seconds - sum of their rounds' work) / R, everything that is not sampling,
scoring or an optimizer step: launcher and interpreter start, imports, loading models and
inputs (checkpoint reads and their hashing included), writing outputs (checkpoints,
rollouts, scores, manifests), the block's in-memory all-gather of the rollout, the trainer's
planning and routing probes, process exit. It is split per job, summing to wall - work, into
``launcher`` (wall - the longest rank's process seconds), ``import`` / ``load`` (the job's
recorded ``time.import`` / ``time.load``: a stage's first metric line, the block's record),
``work span, not work`` (the recorded ``time.work`` - the work above: a block's all-gathers,
score and metric writes and its last checkpoint's write; a train job's planning and probes)
and ``after work`` (the longest process's seconds - import - load - recorded work: writing
outputs, a train job's checkpoint, and exit). Reported per K: rounds, jobs, wall, work and
overhead per round, the overhead's share of the wall, and ratios vs K = 1.

Then the projection to one 8-GPU node (:func:`block_projection`), for the settings of
:data:`round_overhead.SETTINGS` at their presets' ``workflow.rounds_per_job`` and
``keep_every``: K = 1 is :func:`round_overhead.project`'s "after" tree (fed with this run's
K = 1 round 1, measured with round_overhead's probe and read by its
:func:`round_overhead.projection_inputs`, and the hashing rates measured here by
:func:`round_overhead.hash_rates`); a block's round pays no start-up, imports, model loads or
checkpoint read, writes a checkpoint (and its hashing) only for the kept rounds and each
block's last, the rollout only for kept rounds, and adds the in-memory all-gather of the
rollout; the block's one-time start-up (measured here), resume (reading and hashing the
previous block's checkpoint, as round_overhead's train stage does) and reward model build are
amortised over its rounds. Beside the paper's step time and the target (<= 5% of it). Every
assumption is printed (:data:`ASSUMPTIONS`, :data:`round_overhead.ASSUMPTIONS`).

    python benchmarks/block_overhead.py --out results/bench/block_overhead.json  # ~50 min
    python benchmarks/block_overhead.py --smoke --out /tmp/block_overhead_smoke.json  # ~6 min
    python benchmarks/block_overhead.py --from-json results/bench/block_overhead.json

``--rounds-k1 / --rounds-k4 / --rounds-k25`` set R per mode (0 skips one; defaults 4, 4, 25).
At 0.5B on 2 shared cores a round's work is 60-100 s, so K = 25's 25 rounds alone take
25-40 min (the whole run took 49 min on 2026-12-03); ``--rounds-k1 2`` saves ~5 min. Linux only
(``/proc``). At 0.5B float32 parameters a checkpoint is ~6 GB; at most two are on disk at once
(``--workdir``, default a temporary folder, deleted at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import round_overhead as ro
from _common import GB, config_with, gb, machine, table

HERE = ro.HERE
MODES = (1, 4, 25)  # K: rounds per job (1: the single-round jobs)
TRAIN_PARTS = ("forward", "backward", "optimizer")
COMPONENTS = ("launcher", "import", "load", "work span, not work", "after work")
SMOKE = {"params": 2e7, "rounds_k1": 2, "rounds_k4": 4, "rounds_k25": 25}
# What the block projection assumes beyond round_overhead.ASSUMPTIONS (printed with them).
ASSUMPTIONS: dict[str, Any] = {
    # all_gather_object of each rank's shard (pickled on the host, copied to the GPU, gathered
    # over NVLink, copied back, unpickled) and the images' gather to rank 0: the host side
    # bounds it. Each rank receives (N - 1) / N of the whole rollout (images included).
    "rollout_gather_bytes_per_s": 5 * GB,
    "target_fraction_of_step": 0.05,
    "target_s": {"flux": 12.0, "qwenimage": 35.0},  # about 5% of the paper's JAGG step
    "block_start_up": "measured here: a block job's launcher + imports (mean over its jobs), "
    "the same on a node, as round_overhead takes its measured start-ups",
    "block_resume": "a block resumes from the previous block's checkpoint: it reads and hashes "
    "'policy in' and 'trainer in' as the measured train stage does (round_overhead's "
    "hash_pattern), plus the base when LoRA; reward models built once (hpsv21_build_s after)",
    "one_time_amortised": "over the run's rounds: blocks / rounds (a shorter last block counts "
    "as one)",
    "writes": "checkpoint (and its hashing while writing) for the kept rounds "
    "(workflow.keep_every, evaluated rounds) and each block's last; the rollout for the kept "
    "rounds only (K = 1: both every round); rates as round_overhead (NVMe, blake3 1 thread)",
    "not_projected": "model construction, sharding and optimizer set-up beyond storage reads "
    "and hashing (as round_overhead), score tables and metric lines, evaluations (separate "
    "jobs or in-block, the same work in both modes)",
}


def stamp() -> str:
    """The time of day, for progress lines."""
    return time.strftime("%H:%M:%S")


def say(message: str) -> None:
    """A progress line with its time."""
    print(f"[{stamp()}] {message}", flush=True)


# ------------------------------------------------------------------------------------------
# Metric lines and one job's accounting
# ------------------------------------------------------------------------------------------


def metric_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a metrics file."""
    return [json.loads(text) for text in path.read_text().splitlines() if text.strip()]


def stage_work(stage: str, lines: Sequence[dict[str, Any]]) -> float:
    """Work seconds a stage's metric lines record (see the module docstring)."""
    if stage == "rollout":
        return sum(line["seconds"] for line in lines)
    if stage == "score":
        return sum(line.get("time.work", 0.0) for line in lines)
    return sum(line[f"time.{part}"] for line in lines for part in TRAIN_PARTS)


def job_row(
    name: str, run: dict[str, Any], work: float, recorded: dict[str, float]
) -> dict[str, Any]:
    """One job: wall, recorded split, work, the overhead's components, I/O, load average."""
    processes = run["processes"]
    longest = max(p["seconds"] for p in processes)
    parts = {part: recorded.get(part, 0.0) for part in ro.PARTS}
    components = {
        "launcher": run["wall"] - longest,
        "import": parts["import"],
        "load": parts["load"],
        "work span, not work": parts["work"] - work,
        "after work": longest - sum(parts.values()),
    }
    return {
        "job": name,
        "ranks": run["ranks"],
        "wall": run["wall"],
        "process_seconds": [p["seconds"] for p in processes],
        "time": parts,
        "work": work,
        "overhead": run["wall"] - work,
        "components": components,
        "read_bytes": sum(p["io"]["read_bytes"] for p in processes),
        "write_bytes": sum(p["io"]["write_bytes"] for p in processes),
        "hwm": [p["hwm"] for p in processes],
        "load_average": os.getloadavg(),
    }


class RoundWatcher:
    """Prints a line as each round of a running block job finishes (its train.jsonl appears)."""

    def __init__(self, run_dir: Path, rounds: range, label: str) -> None:
        self.run_dir, self.rounds, self.label = run_dir, rounds, label
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        from jagg_pipeline.io.artifacts import round_name

        pending, start = list(self.rounds), time.perf_counter()
        while pending and not self.done.wait(2.0):
            while (
                pending
                and (self.run_dir / round_name(pending[0]) / "metrics" / "train.jsonl").is_file()
            ):
                say(f"{self.label}: round {pending[0]} done ({time.perf_counter() - start:.0f} s)")
                pending.pop(0)

    def __enter__(self) -> RoundWatcher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()


# ------------------------------------------------------------------------------------------
# The modes
# ------------------------------------------------------------------------------------------


def measure_single(
    tree: ro.Tree, setup: dict[str, Any], rounds: int, probe: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """K = 1: rounds 0 .. R-1 as single-round jobs; (the mode, round 1 as round_overhead has it).

    The second value holds round_overhead's per-stage rows of round 1 and the artifact sizes
    of rounds 0 and 1 (its ``results`` layout for one tree), for the projection.
    """
    from jagg_pipeline.io.artifacts import round_name

    base, config = setup["work"] / "k1", setup["config"]
    jobs, work = [], {}
    measured: dict[str, Any] = {"rounds": {}, "sizes": {}}
    for round_index in range(rounds):
        here = base / round_name(round_index)
        here.mkdir(parents=True)
        previous = base / round_name(round_index - 1) / "checkpoint"
        folders = {
            "round": round_index,
            "prompts": setup["prompts"],
            "policy": "base" if round_index == 0 else str(previous),
            "conditioning": str(setup["conditioning"]),
            "rollouts": str(here / "rollout"),
            "scores": str(here / "scores"),
        }
        work[round_index] = {}
        for stage in ("rollout", "score", "train"):
            out = here / ro.FOLDERS[stage]
            argv = ro.stage_argv(stage, config, folders | {"out": str(out)})
            say(f"K=1 round {round_index} {stage}")
            run = ro.run_stage(
                tree, stage, argv, probe, base / f"{stage}-{round_index}", setup["drop"]
            )
            lines = metric_lines(out / "metrics.jsonl")
            seconds = stage_work(stage, lines)
            work[round_index][stage] = seconds
            row = job_row(f"round {round_index} {stage}", run, seconds, ro.recorded(out))
            jobs.append(row)
            say(f"K=1 round {round_index} {stage}: {row['wall']:.1f} s, work {seconds:.1f} s")
            if round_index <= 1:
                stage_row = ro.summarize_stage(run, base, round_index)
                stage_row["recorded"] = ro.recorded(out)
                measured["rounds"].setdefault(str(round_index), {})[stage] = stage_row
        if round_index <= 1:
            measured["sizes"][str(round_index)] = ro.artifact_sizes(here)
        shutil.rmtree(previous, ignore_errors=True)  # round r-1's checkpoint: r has trained
    shutil.rmtree(base / round_name(rounds - 1) / "checkpoint", ignore_errors=True)
    return {"k": 1, "rounds": rounds, "jobs": jobs, "work": work}, measured


def measure_blocks(
    tree: ro.Tree, setup: dict[str, Any], k: int, rounds: int, probe: Path
) -> dict[str, Any]:
    """K > 1: rounds 0 .. R-1 in block jobs of K rounds, each from the previous's checkpoint."""
    from jagg_pipeline.io.artifacts import round_name

    base = setup["work"] / f"k{k}"
    run_dir = base / "run"
    base.mkdir(parents=True)
    jobs, work, in_round, records = [], {}, {}, []
    policy = "base"
    for first in range(0, rounds, k):
        last = first + k - 1
        end = run_dir / round_name(last)
        checkpoint, record = end / "checkpoint", end / "block.json"
        argv = ["block", "--config", str(setup["config"]), "--policy", policy]
        argv += ["--run-dir", str(run_dir), "--rounds", str(first), str(last)]
        argv += ["--conditioning", str(setup["conditioning"])]
        argv += ["--checkpoint", str(checkpoint), "--record", str(record)]
        label = f"K={k} block {first}-{last}"
        say(label)
        with RoundWatcher(run_dir, range(first, last + 1), label):
            run = ro.run_stage(
                tree, "block", argv, probe, base / f"block-{first}-{last}", setup["drop"]
            )
        data = json.loads(record.read_text())
        records.append(data)
        total = 0.0
        for round_index in range(first, last + 1):
            metrics = run_dir / round_name(round_index) / "metrics"
            work[round_index] = {
                stage: stage_work(stage, metric_lines(metrics / f"{stage}.jsonl"))
                for stage in ("rollout", "score", "train")
            }
            seconds = sum(work[round_index].values())
            total += seconds
            in_round[round_index] = data["seconds"]["rounds"][str(round_index)] - seconds
        row = job_row(label, run, total, data["time"])
        row["in_round_not_work"] = {r: in_round[r] for r in range(first, last + 1)}
        jobs.append(row)
        say(f"{label}: {row['wall']:.1f} s, work {total:.1f} s")
        if policy != "base":
            shutil.rmtree(policy, ignore_errors=True)  # the previous block's checkpoint
        policy = str(checkpoint)
    shutil.rmtree(policy, ignore_errors=True)
    return {"k": k, "rounds": rounds, "jobs": jobs, "work": work, "records": records}


def summarize_mode(mode: dict[str, Any]) -> dict[str, Any]:
    """A mode's totals and per-round figures (see the module docstring)."""
    jobs, rounds = mode["jobs"], mode["rounds"]
    wall = sum(job["wall"] for job in jobs)
    work = sum(job["work"] for job in jobs)
    out = {
        "k": mode["k"],
        "rounds": rounds,
        "jobs": len(jobs),
        "wall_per_round": wall / rounds,
        "work_per_round": work / rounds,
        "overhead_per_round": (wall - work) / rounds,
        "overhead_share": (wall - work) / wall,
        "components_per_round": {
            c: sum(job["components"][c] for job in jobs) / rounds for c in COMPONENTS
        },
        "work_by_stage_per_round": {
            stage: sum(w[stage] for w in mode["work"].values()) / rounds
            for stage in ("rollout", "score", "train")
        },
        "load_average": [
            min(j["load_average"][0] for j in jobs),
            max(j["load_average"][0] for j in jobs),
        ],
    }
    if mode["k"] == 1 and rounds > 1:  # rounds from a checkpoint (round 0 reads the base)
        later = [j for j in jobs if not j["job"].startswith("round 0 ")]
        out["steady_overhead_per_round"] = sum(j["overhead"] for j in later) / (rounds - 1)
    if mode["k"] > 1:
        # Inside the rounds, not work: the all-gather, score and metric writes; the rounds
        # that write no checkpoint (every block's last writes one).
        inner = [
            s
            for job in jobs
            for r, s in job["in_round_not_work"].items()
            if (int(r) + 1) % mode["k"]
        ]
        out["in_round_not_work_per_round"] = sum(inner) / len(inner) if inner else None
        starts = [job["components"]["launcher"] + job["components"]["import"] for job in jobs]
        out["start_up_per_job"] = sum(starts) / len(starts)
    return out


# ------------------------------------------------------------------------------------------
# Projection
# ------------------------------------------------------------------------------------------


def write_plan(preset: Path, rounds_per_job: int | None = None) -> dict[str, Any]:
    """A preset's run: rounds, K, keep_every, blocks and checkpoint/rollout writes per round.

    ``rounds_per_job``: K instead of the preset's ``workflow.rounds_per_job``. K = 1 writes
    both every round; a block writes the checkpoint of its kept rounds and its last, and the
    rollout of its kept rounds.
    """
    from jagg_pipeline.config.yaml_io import read_yaml
    from jagg_pipeline.workflow.runs import blocks, kept_rounds
    from jagg_pipeline.workflow.sections import split

    data, workflow = split(read_yaml(preset))
    config = config_with(data, [])
    k = workflow.rounds_per_job if rounds_per_job is None else rounds_per_job
    rounds = config.train.rounds
    kept = set(kept_rounds(config, workflow.keep_every))
    runs = blocks(rounds, k)
    checkpoints = rounds if k == 1 else len(kept | {b[-1] for b in runs})
    rollouts = rounds if k == 1 else len(kept)
    return {
        "rounds": rounds,
        "rounds_per_job": k,
        "preset_rounds_per_job": workflow.rounds_per_job,
        "keep_every": workflow.keep_every,
        "blocks": len(runs),
        "jobs_per_round": (3 if k == 1 else 1) * len(runs) / rounds,
        "checkpoint_writes_per_round": checkpoints / rounds,
        "rollout_writes_per_round": rollouts / rounds,
    }


def block_projection(
    inputs: dict[str, Any],
    rates: dict[str, float],
    setting: ro.Setting,
    sizes: dict[str, float],
    plan: dict[str, Any],
    block_start_up: float,
) -> dict[str, Any]:
    """Seconds per round on one 8-GPU node: single-round jobs beside blocks of ``plan``'s K.

    ``inputs``: :func:`round_overhead.projection_inputs` (its "after" tree); ``rates``:
    :func:`round_overhead.hash_rates`; ``sizes``: :func:`round_overhead.setting_sizes`;
    ``plan``: :func:`write_plan`; ``block_start_up``: a block job's measured launcher +
    imports. Items are tuples at the two NVMe rates (3, 6 GB/s) where I/O enters.
    """
    io = ro.ASSUMPTIONS["nvme_bytes_per_s"]
    single = ro.project(**inputs, rates=rates, sizes=sizes, setting=setting)
    after = single["items"]["after"]["seconds"]
    rate = rates["blake3_1_thread"]
    artifacts = ro.artifact_bytes(sizes)
    # Resuming from the previous block's checkpoint: what the train stage reads and hashes of it.
    train = inputs["patterns"]["after"]["train"]
    resumed = {
        "ranks": train["ranks"],
        "artifacts": {
            k: v for k, v in train["artifacts"].items() if k in ("policy in", "trainer in")
        },
    }
    _, hashing = ro.projected_hashing(resumed, artifacts, rate)
    hashed = ro.hashed_inputs(resumed, "train", artifacts)
    unhashed = ro.unhashed_reads(True, "train", setting.training, sizes)
    reads = tuple(max(hashed / r - hashing, 0.0) + unhashed / r for r in io)
    build = ro.ASSUMPTIONS["hpsv21_build_s"]["after"]
    per_block = plan["blocks"] / plan["rounds"]
    checkpoints, rollouts = plan["checkpoint_writes_per_round"], plan["rollout_writes_per_round"]
    written = inputs["written_hash"]["after"]
    gather = sizes["rollout"] * (ro.NODE_RANKS - 1) / ro.NODE_RANKS
    both = {
        "0 idle GPUs while sampling": (after["0 idle GPUs while sampling"],) * 2,
        "start-up: launcher, imports": (after["start-ups (measured)"], block_start_up * per_block),
        "input hashing by reading": (after["1 hashing by reading"], hashing * per_block),
        "input reads (policy, base, checkpoint, rollout)": (
            _add(
                after["2 rollout: policy and base reads"],
                after["2 rollout: text encoders"],
                after["3 train: checkpoint, base, rollout reads"],
            ),
            tuple(r * per_block for r in reads),
        ),
        "reward model build": (after["4 reward model build (HPSv2.1)"], (build * per_block,)),
        "rollout write, score reads": (
            after["5 rollout write, score reads"],
            tuple(sizes["rollout"] * rollouts / r for r in io),
        ),
        "checkpoint write": (
            after["checkpoint write"],
            tuple(sizes["checkpoint"] * checkpoints / r for r in io),
        ),
        "hashing while writing": (
            after["1 hashing while writing"],
            (
                (sizes["checkpoint"] * checkpoints + sizes["rollout"] * rollouts)
                / ro.NODE_RANKS
                / rate
                if written
                else 0.0,
            ),
        ),
        "rollout all-gather (in memory)": (
            (0.0,),
            (gather / ASSUMPTIONS["rollout_gather_bytes_per_s"],),
        ),
    }
    items = {
        mode: {name: _tuple(values[index]) for name, values in both.items()}
        for index, mode in enumerate(("single", "block"))
    }
    out: dict[str, Any] = {"setting": setting.name, "plan": plan, "sizes": sizes, "items": items}
    for mode, values in items.items():
        overhead = tuple(
            sum(v[min(i, len(v) - 1)] for name, v in values.items() if not name.startswith("0"))
            for i in (0, 1)
        )
        idle = values["0 idle GPUs while sampling"][0]
        out[mode] = {"overhead_s": overhead, "with_idle_s": tuple(t + idle for t in overhead)}
    out["single_check"] = single["items"]["after"]["overhead_s"]  # round_overhead's own sum
    out["paper_step_s"] = ro.ASSUMPTIONS["paper_step_s"][setting.family]
    out["target_s"] = ASSUMPTIONS["target_s"][setting.family]
    return out


def _tuple(value: Any) -> tuple[float, ...]:
    return tuple(value) if isinstance(value, tuple) else (value,)


def _add(*values: Sequence[float]) -> tuple[float, ...]:
    """Item tuples summed per NVMe rate (a one-value tuple holds at both)."""
    return tuple(sum(v[min(i, len(v) - 1)] for v in values) for i in (0, 1))


def k_sweep(
    inputs: dict[str, Any],
    rates: dict[str, float],
    setting: ro.Setting,
    sizes: dict[str, float],
    preset: Path,
    block_start_up: float,
    ks: Sequence[int],
) -> dict[int, tuple[float, ...]]:
    """The block's overhead per round (with the idle GPUs) at each K of ``ks`` (1: single)."""
    out = {}
    for k in ks:
        projected = block_projection(
            inputs, rates, setting, sizes, write_plan(preset, k), block_start_up
        )
        out[k] = projected["single" if k == 1 else "block"]["with_idle_s"]
    return out


def projections(
    record: dict[str, Any], presets: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """Every setting's projection from a record (None: no K = 1 round 1 or no block)."""
    measured = record.get("k1_round_1")
    blocks = [s for s in record["summary"] if s["k"] > 1]
    if not measured or "1" not in measured["rounds"] or not blocks:
        return None
    # round_overhead's projection inputs, this run's K = 1 as its "after" tree (and, unused,
    # as its "before").
    inputs = ro.projection_inputs({"before": measured, "after": measured})
    start_up = sum(s["start_up_per_job"] for s in blocks) / len(blocks)
    out, sweeps = [], {}
    for setting in ro.SETTINGS:
        preset = presets / f"{setting.preset}.yaml"
        sizes = ro.setting_sizes(setting, presets)
        plan = write_plan(preset)
        projected = block_projection(inputs, record["hash_rates"], setting, sizes, plan, start_up)
        projected["block_start_up_s"] = start_up
        out.append(projected)
        ks = sorted({1, 4, 25, plan["rounds_per_job"]})
        sweeps[setting.name] = k_sweep(
            inputs, record["hash_rates"], setting, sizes, preset, start_up, ks
        )
    return out, sweeps


# ------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------


def print_measured(summary: list[dict[str, Any]]) -> None:
    """Per K: rounds, jobs, per-round wall, work, overhead, share; ratios vs K = 1."""
    reference = next((s for s in summary if s["k"] == 1), None)
    headers = ["K", "rounds", "jobs", "wall s/round", "work s/round", "overhead s/round"]
    headers += ["overhead / wall", "overhead vs K=1", "wall vs K=1"]
    rows = []
    for s in summary:
        ratios = ["-", "-"]
        if reference is not None:
            ratios = [
                f"{s['overhead_per_round'] / reference['overhead_per_round']:.3f}x",
                f"{s['wall_per_round'] / reference['wall_per_round']:.3f}x",
            ]
        rows.append(
            [
                s["k"],
                s["rounds"],
                s["jobs"],
                f"{s['wall_per_round']:.1f}",
                f"{s['work_per_round']:.1f}",
                f"{s['overhead_per_round']:.1f}",
                f"{100 * s['overhead_share']:.1f}%",
                *ratios,
            ]
        )
    print("\nMeasured (2 gloo ranks, this machine): per round")
    print(table(headers, rows))
    print("\nOverhead per round by component (s; they sum to the overhead)")
    rows = [[s["k"], *(f"{s['components_per_round'][c]:.1f}" for c in COMPONENTS)] for s in summary]
    print(table(["K", *COMPONENTS], rows))
    print("\nWork per round by stage (s) and the 1-minute load average at the jobs' ends")
    rows = [
        [
            s["k"],
            *(f"{s['work_by_stage_per_round'][x]:.1f}" for x in ("rollout", "score", "train")),
            "{:.2f}-{:.2f}".format(*s["load_average"]),
        ]
        for s in summary
    ]
    print(table(["K", "rollout", "score", "train", "load average"], rows))
    for s in summary:
        if "steady_overhead_per_round" in s:
            print(
                f"K=1, rounds 1..{s['rounds'] - 1} only (from a checkpoint): overhead "
                f"{s['steady_overhead_per_round']:.1f} s/round"
            )
        if s.get("in_round_not_work_per_round") is not None:
            print(
                f"K={s['k']}: inside a round, not work (all-gather, score and metric writes; "
                f"rounds writing no checkpoint): {s['in_round_not_work_per_round']:.2f} s/round; "
                f"start-up (launcher + imports) {s['start_up_per_job']:.1f} s/job"
            )


def spread(values: Sequence[float]) -> str:
    """Seconds as ``12`` or, at the two NVMe rates, ``24-12`` (one decimal under 10 s)."""
    shown = [f"{v:.1f}" if abs(v) < 10 else f"{v:.0f}" for v in values]
    return "-".join(dict.fromkeys(shown))


def verdict(values: Sequence[float], target: float) -> str:
    """PASS / FAIL of seconds at both NVMe rates against ``target``."""
    if max(values) <= target:
        return "PASS"
    if min(values) <= target:
        return "PASS at 6 GB/s only"
    return "FAIL"


def print_projection(projected: list[dict[str, Any]], sweeps: dict[str, Any]) -> None:
    """Per setting: single-round jobs beside blocks at the preset's K, the paper, the target."""
    for p in projected:
        plan, sizes = p["plan"], p["sizes"]
        k = plan["rounds_per_job"]
        print(
            f"\n{p['setting']}: K = {k}, keep_every {plan['keep_every']}, {plan['rounds']} rounds "
            f"in {plan['blocks']} blocks; checkpoint {gb(sizes['checkpoint'])} GB written "
            f"{plan['checkpoint_writes_per_round']:.4f}/round, rollout {gb(sizes['rollout'])} "
            f"GB written {plan['rollout_writes_per_round']:.4f}/round; block start-up "
            f"{p['block_start_up_s']:.1f} s (measured)"
        )
        rows = [
            [name, spread(p["items"]["single"][name]), spread(p["items"]["block"][name])]
            for name in p["items"]["single"]
        ]
        step_exact, step_jagg = p["paper_step_s"]
        target = p["target_s"]
        single, block = p["single"]["with_idle_s"], p["block"]["with_idle_s"]
        rows += [
            [
                "overhead (without item 0)",
                spread(p["single"]["overhead_s"]),
                spread(p["block"]["overhead_s"]),
            ],
            ["overhead with idle GPUs", spread(single), spread(block)],
            [
                "share of the paper's step (exact-JAGG)",
                f"{100 * max(single) / step_exact:.1f}-{100 * max(single) / step_jagg:.1f}%",
                f"{100 * max(block) / step_exact:.1f}-{100 * max(block) / step_jagg:.1f}%",
            ],
            [
                f"target <= {target:.0f} s (5% of {step_jagg:.0f} s)",
                verdict(single, target),
                verdict(block, target),
            ],
            ["paper step s (exact -> JAGG)", f"{step_exact:.0f} -> {step_jagg:.0f}", ""],
        ]
        print(table(["s per round, one 8-GPU node (NVMe 3-6 GB/s)", "K = 1", f"K = {k}"], rows))
    print("\nOverhead per round with idle GPUs (s, NVMe 3-6 GB/s) by K (1: single-round jobs)")
    ks = sorted({k for sweep in sweeps.values() for k in sweep}, key=int)
    rows = [
        [name, *(spread(sweep[k]) if k in sweep else "-" for k in ks)]
        for name, sweep in sweeps.items()
    ]
    print(table(["setting", *(f"K={k}" for k in ks)], rows))


def print_assumptions() -> None:
    """Every assumption of the projection: round_overhead's, then the block's."""
    print("\nAssumptions (round_overhead.ASSUMPTIONS, then block_overhead.ASSUMPTIONS):")
    for key, value in {**ro.ASSUMPTIONS, **ASSUMPTIONS}.items():
        if key == "nvme_bytes_per_s" or key.endswith("_bytes") or key.endswith("bytes_per_s"):
            shown = (
                ", ".join(f"{v / GB:g} GB/s" for v in value)
                if isinstance(value, tuple)
                else f"{value / GB:g} GB{'/s' if key.endswith('per_s') else ''}"
            )
        else:
            shown = value
        print(f"  {key}: {shown}")


def report(record: dict[str, Any], presets: Path) -> None:
    """Print everything and add the projection to ``record``."""
    print_measured(record["summary"])
    rates = record["hash_rates"]
    shown = ", ".join(
        f"{k} {v / GB:.2f} GB/s" for k, v in rates.items() if k.startswith(("sha", "bl"))
    )
    print(f"\nhashing a 1 GiB file from the page cache: {shown}")
    done = projections(record, presets)
    record["assumptions"] = {"round_overhead": ro.ASSUMPTIONS, "block_overhead": ASSUMPTIONS}
    if done is None:
        print("\n(no projection: it needs K = 1 with >= 2 rounds and a block mode)")
        record["projection"] = None
        return
    projected, sweeps = done
    print_projection(projected, sweeps)
    print_assumptions()
    record["projection"] = projected
    record["k_sweep"] = sweeps


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, help="transformer parameters (default 5e8)")
    for k, default in zip(MODES, (4, 4, 25), strict=True):
        parser.add_argument(
            f"--rounds-k{k}", type=int, help=f"rounds R for K = {k} (default {default}; 0: skip)"
        )
    parser.add_argument("--smoke", action="store_true", help=f"a quick run: {SMOKE}")
    parser.add_argument("--workdir", type=Path, help="where rounds go (default: a temp dir)")
    parser.add_argument("--presets", type=Path, default=HERE / "presets")
    parser.add_argument("--out", type=Path, help="JSON file of the measurements")
    parser.add_argument("--from-json", type=Path, help="report a finished run's --out again")
    args = parser.parse_args(argv)
    defaults = (
        SMOKE if args.smoke else {"params": 5e8, "rounds_k1": 4, "rounds_k4": 4, "rounds_k25": 25}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for k in MODES:
        rounds = getattr(args, f"rounds_k{k}")
        if rounds < 0 or rounds % k:
            parser.error(f"--rounds-k{k} {rounds}: need a multiple of {k} (0 skips it)")
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model, encode the pool, run every mode, measure the hashing rates."""
    work = Path(tempfile.mkdtemp(prefix="block-overhead-", dir=args.workdir)).resolve()
    try:
        say(f"work folder {work}; load average {os.getloadavg()}")
        model = ro.build_model(args.params, work)
        say(
            f"model: FluxTransformer2DModel {model['kwargs']}: {model['parameters']:,} parameters "
            f"(target {args.params:,.0f}), {gb(model['transformer_bytes'])} GB"
        )
        config, prompts = ro.write_config(work, model["path"])
        probe = work / "probe"
        probe.mkdir()
        (probe / f"{ro.PROBE_MODULE}.py").write_text(ro.PROBE)
        after = ro.tree_of("after", HERE)
        tree = ro.Tree(after.name, after.path, after.encode, (*after.ranked, "block"))
        if not after.encode:
            raise SystemExit(f"{HERE}: no encode command")
        setup = {
            "work": work,
            "config": config,
            "prompts": prompts,
            "conditioning": work / "conditioning",
            "drop": [work, Path(model["path"])],
        }
        say("encode (once, for every mode)")
        folders = {"prompts": prompts, "policy": "base", "out": str(setup["conditioning"])}
        ro.run_stage(
            tree,
            "encode",
            ro.stage_argv("encode", config, folders),
            probe,
            work / "encode",
            setup["drop"],
        )
        modes, measured = [], None
        for k in MODES:
            rounds = getattr(args, f"rounds_k{k}")
            if not rounds:
                continue
            say(f"K={k}: {rounds} rounds")
            if k == 1:
                mode, measured = measure_single(tree, setup, rounds, probe)
            else:
                mode = measure_blocks(tree, setup, k, rounds, probe)
            modes.append(mode)
        say("hashing rates")
        rates = ro.hash_rates(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"model": model, "modes": modes, "k1_round_1": measured, "hash_rates": rates}


def main(argv: Sequence[str] | None = None) -> None:
    """Measure, summarize, project, print, write the JSON."""
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.from_json:
        record = json.loads(args.from_json.read_text())
    else:
        start = time.perf_counter()
        record = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine(),
            "load_average_start": os.getloadavg(),
        }
        record |= measure(args)
        record["load_average_end"] = os.getloadavg()
        record["seconds"] = time.perf_counter() - start
        record["summary"] = [summarize_mode(mode) for mode in record["modes"]]
        model = record["model"]
        record["args"] = {k: str(v) for k, v in vars(args).items()}
        print(
            f"\nmodel: {model['parameters']:,} parameters, {gb(model['transformer_bytes'])} GB; "
            f"run {record['seconds'] / 60:.1f} min; load average at start "
            f"{record['load_average_start'][0]:.2f}, end {record['load_average_end'][0]:.2f}"
        )
    report(record, args.presets)
    if args.out and not args.from_json:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
