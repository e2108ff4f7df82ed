"""The speed benchmark: exact vs JAGG (reuse on/off, joint/sequential backward) vs no_interp.

The update stage of every mode on the same trajectories, in one process.

For each backbone a trajectory batch is sampled once (velocities recorded, as a rollout
stores them) with a GRPO objective on it; then every case (mode, W, jagg_frac, reuse) runs
one optimizer step's update (gradient accumulation + AdamW at lr 0, so the weights, and with
them the on-policy velocities, stay valid) after ``warmup`` untimed passes, interleaved:
A B C ... A B C ..., ``repeats`` times, at a fixed thread count. Each sample splits the
update into forward (inside network calls), backward (the rest of the engine) and optimizer
seconds, and counts network forward rows, forward and backward calls and reused rows; the
peak of live activation bytes saved for backward is measured once per case (CUDA: the
allocator's peak). Beside each median speed-up stands the analytic prediction in
forward-equivalents (a backward costs two forwards): an exact window of n steps 3n, a JAGG
window n + 4, with reuse 6; the sequential endpoint backward does the same work in two
backward calls, holding one endpoint's activations at a time instead of two.

A whole round (rollout + score + update) per backbone gives the per-round gain, and a
two-rank (gloo) FSDP2 run counts reduce-scatters per optimizer step in every mode.

This module measures: the cases, the benchmark backbones, the timing, the activation peaks,
the reduce-scatter count (:mod:`jagg_pipeline.bench.worker` under torchrun), and
:func:`run_bench`'s report dict with its medians, quartiles and whole-round gain.
:mod:`jagg_pipeline.bench.report` turns that dict into files, the figure and the table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from jagg_pipeline.backbones import Backbone
from jagg_pipeline.bench.config import BENCH_BACKBONES, BenchConfig
from jagg_pipeline.bench.gradcheck import GradcheckProblem, build_problem
from jagg_pipeline.bench.gradcheck_config import GradcheckConfig
from jagg_pipeline.core import jagg, sde
from jagg_pipeline.core.options import EngineOptions
from jagg_pipeline.support.timing import ForwardClock

WIDE = {"heads": 4, "head_dim": 64}  # width 256
# The timed parts of an update and the counts of a row: report.py writes a column of each.
SECONDS = ("forward", "backward", "optimizer", "update")
COUNTS = ("forward_rows", "network_calls", "backward_calls", "reused_rows")


@dataclass(frozen=True)
class Case:
    """One update-stage configuration."""

    mode: str
    window: int
    frac: float
    reuse: bool = False
    backward: str = "joint"  # jagg.endpoint_backward
    anchors: str = "separate"  # jagg.anchors

    @property
    def name(self) -> str:
        if self.mode == "exact":
            return "exact"
        reuse = "+reuse" if self.reuse else ""
        shared = " shared" if self.anchors == "shared" else ""
        sequential = " sequential" if self.backward == "sequential" else ""
        return f"{self.mode}{reuse} W={self.window} f={self.frac:g}{shared}{sequential}"


def save_bench_backbone(name: str, directory: str | Path, seed: int = 0) -> Path:
    """Save the toy-world pipeline (random weights) of benchmark backbone ``name``."""
    from jagg_pipeline.toyworld.models import build_toy_pipeline

    if name not in BENCH_BACKBONES:
        raise ValueError(f"unknown benchmark backbone {name!r}; choose from {BENCH_BACKBONES}")
    family = name.split("-", 1)[1]
    width = WIDE if name.startswith("wide-") else {}
    build_toy_pipeline(family, seed, **width).save_pretrained(directory)
    return Path(directory)


def load_saved_backbone(name: str, directory: str | Path, device: str, **spec: Any) -> Backbone:
    """Load a pipeline saved by :func:`save_bench_backbone` through its family's adapter.

    ``spec``: backbone settings that replace the toy world's (``dtype="bfloat16"``, ...).
    """
    from jagg_pipeline.backbones import load_backbone
    from jagg_pipeline.config.run import BackboneConfig
    from jagg_pipeline.toyworld.models import toy_backbone_options

    options = toy_backbone_options(name.split("-", 1)[1]) | spec
    return load_backbone(BackboneConfig(path=str(directory), device=device, **options))


def load_bench_backbone(name: str, device: str, seed: int = 0, **spec: Any) -> Backbone:
    """Benchmark backbone ``name``, saved in a temporary directory and loaded (one process)."""
    with tempfile.TemporaryDirectory(prefix="jagg-bench-") as directory:
        save_bench_backbone(name, directory, seed)
        return load_saved_backbone(name, directory, device, **spec)


def analytic_rows(case: Case, steps: Sequence[int]) -> tuple[int, int]:
    """(rows with grad, interior rows without) of one update of ``case`` over ``steps``.

    Rows with grad: every exact step and every anchor (a forward and a backward each);
    interior rows: the no-grad forwards of interpolated steps, none when the rollout's
    velocities are reused or the mode drops interior signals (no_interp).
    """
    windows = jagg.split_windows(steps, case.window, case.anchors)
    routed = jagg.route_windows(len(windows), case.frac)
    if case.mode == "exact":
        return len(steps), 0
    units = jagg.approximated_units(routed, case.anchors)
    exact = sum(len(w) for w, r in zip(windows, routed, strict=True) if not r)
    grad_rows = interior = 0
    for unit in units:
        chunks = [windows[w] for w in unit]
        n = sum(len(c) for c in chunks)
        anchors = len(jagg.layout_anchors(jagg.layout_intervals(chunks)))
        grad_rows += anchors
        if not (case.reuse or case.mode == "no_interp"):
            interior += n - anchors
    return exact + grad_rows, interior


def predicted_cost(case: Case, steps: Sequence[int]) -> int:
    """The update's cost in forward-equivalents (backward = 2 forwards; optimizer not counted).

    3 per row with grad (forward + backward), 1 per interior row (:func:`analytic_rows`).
    """
    grad_rows, interior = analytic_rows(case, steps)
    return 3 * grad_rows + interior


class SavedActivations:
    """Peak live bytes of the tensors autograd saves for backward (parameters excluded)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = {p.data_ptr() for p in params}
        self.live = 0
        self.peak = 0

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in self.params:
            nbytes = tensor.numel() * tensor.element_size()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._release, nbytes)
        return tensor

    @contextmanager
    def measure(self) -> Iterator[SavedActivations]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


class Bench:
    """One backbone's trajectories, objective and optimizer; runs and times cases."""

    def __init__(self, backbone: Backbone, settings: BenchConfig) -> None:
        self.backbone = backbone
        self.settings = settings
        self.problem: GradcheckProblem = build_problem(
            GradcheckConfig(
                trajectory="sde",
                dtype="float32",
                num_steps=settings.num_steps,
                batch=settings.batch,
                seed=settings.seed,
                window=settings.window,
            ),
            backbone,
        )
        self.device = self.problem.latents.device
        self.clock = ForwardClock(self.device)
        self.velocity = self.clock.wrap(backbone.velocity)
        # lr 0: the step costs what a real one does and changes nothing, so every case
        # starts from the weights that sampled the trajectories (on-policy).
        self.optimizer = torch.optim.AdamW(self.problem.params, lr=0.0)
        # FSDP2's gradient sync switch (the reduce-scatter count); None: one process.
        self.set_sync: Callable[[bool], None] | None = None

    def run(self, case: Case) -> dict[str, Any]:
        """One timed update of ``case``: seconds (forward, backward, optimizer) and counts."""
        p = self.problem
        windows = jagg.split_windows(p.steps, case.window, case.anchors)
        routed = jagg.route_windows(len(windows), case.frac)
        batch = p.batch(p.velocities if case.reuse else None)
        self.clock.seconds = 0.0
        self.clock.sync()
        start = time.perf_counter()
        (stats,) = jagg.accumulate_gradient(
            self.velocity,
            [batch],
            windows,
            routed,
            case.mode,
            EngineOptions(anchors=case.anchors, endpoint_backward=case.backward),
            self.set_sync,
        )
        self.clock.sync()
        engine = time.perf_counter() - start
        start = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.clock.sync()
        optimizer = time.perf_counter() - start
        forward = self.clock.seconds
        return {
            "forward": forward,
            "backward": engine - forward,
            "optimizer": optimizer,
            "update": engine + optimizer,
            "forward_rows": sum(w.forward_rows for w in stats),
            "network_calls": sum(w.network_calls for w in stats),
            "backward_calls": sum(w.backward_calls for w in stats),
            "reused_rows": sum(w.reused_rows for w in stats),
        }

    def peak_bytes(self, case: Case) -> int:
        """Peak activation memory of one update of ``case`` (CUDA: allocator peak above idle)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            idle = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.run(case)
            return torch.cuda.max_memory_allocated(self.device) - idle
        with SavedActivations(self.problem.params).measure() as meter:
            self.run(case)
        return meter.peak

    def rollout_and_score(self) -> dict[str, float]:
        """Seconds of a rollout of the same batch (sampling + decoding) and of scoring it."""
        from jagg_pipeline.rewards.toy_attributes import toy_attributes

        p, backbone = self.problem, self.backbone
        masks = sde.full_trajectory_masks(self.settings.num_steps)
        gen = torch.Generator().manual_seed(self.settings.seed)
        noise = backbone.initial_noise(len(p.latents), gen).to(self.device)
        self.clock.sync()
        start = time.perf_counter()
        with torch.no_grad():
            trajectory = sde.sample(
                backbone.velocity, p.cond, noise, p.sigmas, masks, p.coeffs, gen
            )
            images = backbone.decode(trajectory.latents[:, -1])
        self.clock.sync()
        rollout = time.perf_counter() - start
        start = time.perf_counter()
        toy_attributes(images.float().clamp(0, 1), p.prompts)
        return {"rollout": rollout, "score": time.perf_counter() - start}


def cases_for(name: str, settings: BenchConfig) -> list[Case]:
    """The headline cases on every backbone, plus the W x jagg_frac grid on the sweep one."""
    cases = headline_cases(settings.window)
    if name == settings.sweep_backbone:
        for window in settings.windows:
            for frac in settings.fracs:
                for mode, reuse in (("jagg", False), ("jagg", True), ("no_interp", False)):
                    cases.append(Case(mode, window, frac, reuse))
    return list(dict.fromkeys(cases))  # headline cells already in the grid appear once


def headline_cases(window: int) -> list[Case]:
    """The cases timed on every backbone.

    Exact, JAGG with and without reuse under both endpoint backwards, no_interp, then shared
    anchors with and without reuse (and sequential with reuse).
    """
    return [
        Case("exact", window, 0.0),
        Case("jagg", window, 1.0),
        Case("jagg", window, 1.0, backward="sequential"),
        Case("jagg", window, 1.0, reuse=True),
        Case("jagg", window, 1.0, reuse=True, backward="sequential"),
        Case("no_interp", window, 1.0),
        Case("jagg", window, 1.0, anchors="shared"),
        Case("jagg", window, 1.0, reuse=True, anchors="shared"),
        Case("jagg", window, 1.0, reuse=True, backward="sequential", anchors="shared"),
    ]


# _summary and _whole_round stay with the measuring: their figures are part of the report
# dict run_bench returns (bench.json), not something only the printed table derives.
def _summary(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else ordered * 3
    return {
        "median": statistics.median(ordered),
        "q1": quartiles[0],
        "q3": quartiles[-1],
        "min": ordered[0],
        "max": ordered[-1],
    }


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench_backbone(
    name: str,
    settings: BenchConfig,
    progress: Callable[[str], None] = _stderr,
    sweep: bool = True,
) -> dict[str, Any]:
    """Every case of ``name`` timed interleaved; medians, spread, ratios and predictions.

    ``sweep`` False: the headline cases only, even on the sweep backbone.
    """
    backbone = load_bench_backbone(name, settings.device, settings.seed)
    bench = Bench(backbone, settings)
    cases = cases_for(name, settings) if sweep else headline_cases(settings.window)
    exact = cases[0]
    for _ in range(settings.warmup):
        for case in cases:
            bench.run(case)
    samples: dict[Case, list[dict[str, Any]]] = {case: [] for case in cases}
    rounds: list[dict[str, float]] = []
    for repeat in range(settings.repeats):
        progress(f"{name}: repeat {repeat + 1}/{settings.repeats} ({len(cases)} cases)")
        for case in cases:
            samples[case].append(bench.run(case))
        if settings.whole_round:
            rounds.append(bench.rollout_and_score())
    steps = bench.problem.steps
    rows = []
    for case in cases:
        runs = samples[case]
        update = [r["update"] for r in runs]
        exact_update = [r["update"] for r in samples[exact]]
        # Ratios per repeat (exact and case measured side by side), then their median.
        ratios = [e / u for e, u in zip(exact_update, update, strict=True)]
        engine = [r["forward"] + r["backward"] for r in runs]
        exact_engine = [r["forward"] + r["backward"] for r in samples[exact]]
        rows.append(
            {
                "backbone": name,
                "case": case.name,
                **asdict(case),
                "seconds": {key: _summary([r[key] for r in runs]) for key in SECONDS},
                "speedup": _summary(ratios),
                "engine_speedup": _summary(
                    [e / u for e, u in zip(exact_engine, engine, strict=True)]
                ),
                "predicted_speedup": predicted_cost(exact, steps) / predicted_cost(case, steps),
                "analytic_rows": analytic_rows(case, steps)[0],
                **{key: runs[0][key] for key in COUNTS},
                "peak_activation_bytes": bench.peak_bytes(case),
            }
        )
    params = bench.problem.params
    # Weights, gradients and AdamW's two moments: the same in every mode.
    state = 4 * sum(p.numel() * p.element_size() for p in params)
    for row in rows:
        row["memory_vs_exact"] = (state + row["peak_activation_bytes"]) / (
            state + rows[0]["peak_activation_bytes"]
        )
    result: dict[str, Any] = {
        "backbone": name,
        "parameters": sum(p.numel() for p in params),
        "state_bytes": state,
        "latent_shape": list(backbone.latent_shape),
        "trained_steps": steps,
        "cases": rows,
    }
    if rounds:
        result["round"] = _whole_round(rows, rounds)
    return result


def _whole_round(rows: list[dict[str, Any]], rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Per-round seconds (rollout + score + update) of the headline cases and the gain."""
    rollout = statistics.median(r["rollout"] for r in rounds)
    score = statistics.median(r["score"] for r in rounds)
    names = {case.name for case in headline_cases(rows[0]["window"])}
    headline = {
        row["case"]: row["seconds"]["update"]["median"] for row in rows if row["case"] in names
    }
    exact = rollout + score + headline["exact"]
    return {
        "rollout": rollout,
        "score": score,
        "update": headline,
        "round_speedup": {case: exact / (rollout + score + u) for case, u in headline.items()},
    }


def device_name(device: str) -> str:
    """What was measured on, in words."""
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} (CUDA)"
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model} (CPU, {torch.get_num_threads()} torch thread(s))"


def count_reduce_scatters(settings: BenchConfig, backbone: str) -> dict[str, Any]:
    """FSDP2 reduce-scatters per optimizer step of each headline mode, and the group count.

    Runs :mod:`jagg_pipeline.bench.worker` on ``settings.ranks`` gloo processes (torchrun).
    """
    with tempfile.TemporaryDirectory(prefix="jagg-bench-rs-") as directory:
        # Saved here, once: under torchrun, transformers saves on the main process only.
        saved = save_bench_backbone(backbone, Path(directory) / "backbone", settings.seed)
        out = Path(directory) / "report.json"
        command = [
            str(Path(sys.executable).with_name("torchrun")),
            "--standalone",
            f"--nproc_per_node={settings.ranks}",
            "-m",
            "jagg_pipeline.bench.worker",
            backbone,
            str(saved),
            str(settings.window),
            str(settings.batch),
            str(settings.num_steps),
            str(out),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        if result.returncode != 0:
            raise RuntimeError(f"reduce-scatter count failed:\n{result.stderr[-3000:]}")
        return json.loads(out.read_text())


def run_bench(settings: BenchConfig, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole benchmark: every backbone's cases, the reduce-scatter counts, the device."""
    unknown = sorted(set(settings.backbones) - set(BENCH_BACKBONES))
    if unknown:
        raise ValueError(f"unknown benchmark backbone(s) {unknown}; choose from {BENCH_BACKBONES}")
    torch.set_num_threads(settings.threads)
    report: dict[str, Any] = {
        "settings": asdict(settings),
        "device": device_name(settings.device),
        "torch": torch.__version__,
        "backbones": [bench_backbone(name, settings, progress) for name in settings.backbones],
    }
    if settings.long_steps and settings.sweep_backbone in settings.backbones:
        longer = dataclasses.replace(settings, num_steps=settings.long_steps)
        report["backbones"].append(
            bench_backbone(settings.sweep_backbone, longer, progress, sweep=False)
        )
    if settings.ranks > 1:
        progress(f"reduce-scatters on {settings.ranks} ranks (gloo)")
        report["reduce_scatters"] = count_reduce_scatters(settings, settings.backbones[0])
    return report
