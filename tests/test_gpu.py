"""The GPU suite: the stages, FSDP2 over NCCL, velocity reuse and memory on CUDA kernels.

Marked ``gpu``: collected everywhere, skipped without CUDA (tests/conftest.py), run on a GPU
machine by ``pytest -m gpu`` (or ``benchmarks/gpu_check.sh``, which adds the benchmark and
writes a report). bf16 is the precision of the paper's setting; the tiny backbones keep the
whole suite within minutes.
"""

from __future__ import annotations

import pytest
import torch
from stage_helpers import tiny_checkpoint, write_prompts
from train_helpers import launcher, max_difference, policy_weights, subprocess_env

from jagg_pipeline.toyworld.tiny import TINY_FAMILIES

pytestmark = pytest.mark.gpu

# 6 steps, the SDE window the first 4 (all trained): one JAGG window of W = 4.
SAMPLER = {
    "num_steps": 6,
    "group_size": 4,
    "prompts_per_round": 4,
    "batch_size": 8,
    "trajectory": "segment",
    "segment_steps": 4,
    "segment_start": [0, 0],
}
PRECISIONS = {
    "bf16": {"dtype": "bfloat16"},
    "fp32+bf16 mixed": {"dtype": "float32", "mixed_precision": "bf16"},
}


def gpu_config(family: str, tmp_path, precision: str, **sections):
    """The tiny stage experiment of ``family`` on CUDA in ``precision``; sections update it."""
    from stage_helpers import experiment

    from jagg_pipeline.config.run import from_mapping

    checkpoint = tiny_checkpoint(family, tmp_path)
    prompts = write_prompts(tmp_path / "prompts.txt")
    sections = {
        "backbone": {"device": "cuda", **PRECISIONS[precision]},
        "sampler": SAMPLER,
        "jagg": {"mode": "jagg", "window": 4, "jagg_frac": 1.0},
        "train": {"lr": 1e-4},
        **sections,
    }
    return from_mapping(experiment(family, checkpoint, prompts, **sections))


def run_round(config, tmp_path):
    """Rollout, score, train on CUDA; returns (rollouts, scores, the train result)."""
    from jagg_pipeline.stages.rollout import run_rollout
    from jagg_pipeline.stages.scoring import run_score
    from jagg_pipeline.stages.train import train_round

    rollouts, scores = tmp_path / "rollout", tmp_path / "scores"
    run_rollout(config, "base", config.sampler.prompts, rollouts, progress=False)
    run_score(config, rollouts, scores)
    result = train_round(config, "base", rollouts, scores, tmp_path / "ckpt", progress=False)
    return rollouts, scores, result


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_rollout_train_evaluate_on_cuda_stay_on_policy(family, precision, tmp_path):
    """The first optimizer step is on-policy on GPU kernels: ratio 1 within a hundredth of
    the clip range, the rollout's velocities pass the check and are reused."""
    from jagg_pipeline.stages.evaluate import run_evaluate

    config = gpu_config(family, tmp_path, precision)
    _, _, result = run_round(config, tmp_path)
    first = result.metrics[0]
    print(f"{family} {precision}: max |ratio - 1| {first['max_ratio_dev']:.3g}", end=" ")
    print(f"reuse deviation {[w['reuse_error'] for w in first['windows']]}")
    assert first["max_ratio_dev"] <= config.grpo.clip_range / 100
    assert [w["interior"] for w in first["windows"]] == ["reused"]
    assert not first["skipped"] and first["grad_norm"] > 0
    metrics = run_evaluate(config, tmp_path / "ckpt", tmp_path / "eval", progress=False)
    assert metrics


def test_fsdp2_over_nccl_on_every_gpu_equals_one_process(tmp_path):
    """train under torchrun on every visible GPU (NCCL) gives the one-process update."""
    import subprocess

    from train_helpers import write_config

    gpus = torch.cuda.device_count()
    # Every rank needs its share of micro-batches: one group per micro-batch.
    sampler = {**SAMPLER, "batch_size": 4, "prompts_per_round": 4 * gpus}
    train = {"lr": 1e-4, "nproc": gpus}
    config = gpu_config("flux", tmp_path, "fp32+bf16 mixed", sampler=sampler, train=train)
    rollouts, scores, _ = run_round(config, tmp_path)
    config_file = write_config(config, tmp_path / "config.yaml")
    args = ["--config", str(config_file), "--policy", "base", "--rollouts", str(rollouts)]
    args += ["--scores", str(scores), "--out", str(tmp_path / "sharded")]
    command = [*launcher(gpus), "-m", "jagg_pipeline", "train", *args]
    done = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    one, many = policy_weights(tmp_path / "ckpt"), policy_weights(tmp_path / "sharded")
    # AdamW's first step moves each weight by about lr; bf16 sums in another order differ
    # by rounding only.
    assert max_difference(one, many) <= 0.05 * config.train.lr, max_difference(one, many)


@pytest.mark.parametrize("training", ["full", "lora"])
def test_sharded_sampling_over_nccl_on_every_gpu_equals_one_process(tmp_path, training):
    """rollout under torchrun on every visible GPU, the policy FSDP2-sharded over NCCL, gives
    the one-process rollout: every sample computed in the same micro-batch, alike."""
    import subprocess

    from train_helpers import write_config

    from jagg_pipeline.io.trajectories import load_rollout
    from jagg_pipeline.stages.rollout import run_rollout

    gpus = torch.cuda.device_count()
    # One more micro-batch than GPUs: rank 1 onwards pad with a discarded batch.
    sampler = {**SAMPLER, "batch_size": 4, "prompts_per_round": 4 * (gpus + 1)}
    config = gpu_config(
        "flux",
        tmp_path,
        "bf16",
        sampler=sampler,
        backbone={"device": "cuda", "dtype": "bfloat16", "training": training},
    )
    run_rollout(config, "base", config.sampler.prompts, tmp_path / "one", progress=False)
    config_file = write_config(config, tmp_path / "config.yaml")
    args = ["--config", str(config_file), "--policy", "base", "--out", str(tmp_path / "many")]
    command = [*launcher(gpus), "-m", "jagg_pipeline", "rollout", *args]
    done = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    one, many = load_rollout(tmp_path / "one"), load_rollout(tmp_path / "many")
    for name in ("latents", "log_probs", "images", "seeds", "sample_ids"):
        assert torch.equal(getattr(one, name), getattr(many, name)), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_reused_velocities_equal_recomputed_ones_on_cuda(dtype):
    """The rollout's velocities are what the GPU recomputes at unchanged weights."""
    from jagg_pipeline.bench.gradcheck import GradcheckConfig, build_problem
    from jagg_pipeline.bench.measure import load_bench_backbone

    settings = GradcheckConfig(
        backbone="tiny-flux", trajectory="sde", dtype=dtype, num_steps=9, batch=4, window=4
    )
    problem = build_problem(settings, load_bench_backbone("toy-flux", "cuda", dtype=dtype))
    for endpoint_backward in ("joint", "sequential"):
        recomputed, _ = problem.gradient("jagg", endpoint_backward=endpoint_backward)
        reused, stats = problem.gradient(
            "jagg", known_velocities=problem.velocities, endpoint_backward=endpoint_backward
        )
        windows = [w for w in stats.windows if len(w.steps) > 2]
        print(dtype, endpoint_backward, [w.reuse_error for w in windows])
        assert not any(w.reuse_rejected for w in windows) and stats.reused_rows > 0
        rel = float((reused - recomputed).norm() / recomputed.norm())
        assert rel < (2e-2 if dtype == "bfloat16" else 1e-5), rel


def test_sequential_endpoint_backward_peaks_at_exact_memory_on_cuda():
    """torch.cuda.max_memory_allocated above the idle state, one update per mode, W = 4."""
    from jagg_pipeline.bench.config import BenchConfig
    from jagg_pipeline.bench.measure import Bench, Case, load_bench_backbone

    settings = BenchConfig(device="cuda", batch=8, num_steps=13, window=4)
    bench = Bench(load_bench_backbone("wide-flux", "cuda"), settings)
    peaks = {
        case.name: bench.peak_bytes(case)
        for case in (
            Case("exact", 4, 0.0),
            Case("jagg", 4, 1.0, reuse=True),
            Case("jagg", 4, 1.0, reuse=True, backward="sequential"),
        )
    }
    print({name: f"{peak / 2**20:.1f} MiB" for name, peak in peaks.items()})
    exact, joint, sequential = peaks.values()
    assert sequential <= 1.1 * exact
    assert joint > 1.5 * exact


def test_bench_runs_on_cuda(tmp_path):
    from jagg_pipeline.bench.config import BenchConfig
    from jagg_pipeline.bench.measure import run_bench
    from jagg_pipeline.bench.report import format_report, write_outputs

    settings = BenchConfig(
        backbones=["toy-flux"],
        sweep_backbone="toy-flux",
        windows=[4],
        fracs=[1.0],
        repeats=2,
        warmup=1,
        ranks=1,
        device="cuda",
    )
    report = run_bench(settings, progress=lambda _: None)
    assert "CUDA" in report["device"]
    paths = write_outputs(report, tmp_path)
    assert paths["csv"].is_file()
    print(format_report(report))


def test_forward_clock_times_by_cuda_events_with_one_synchronise(monkeypatch):
    """Wrapped forwards never synchronise; one sync() reads every forward and mark."""
    from jagg_pipeline.support.timing import ForwardClock

    synchronised = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda *a, **k: (synchronised.append(1), real(*a, **k))[1]
    )
    device = torch.device("cuda")
    clock = ForwardClock(device)
    weight = torch.randn(2048, 2048, device=device)
    forward = clock.wrap(lambda x: x @ weight)
    clock.mark("start")
    x = torch.randn(2048, 2048, device=device)
    for _ in range(5):
        x = forward(x).tanh()
    clock.mark("end")
    assert not synchronised and clock.seconds == 0.0
    seconds = clock.sync()
    assert len(synchronised) == 1 and clock.syncs == 1
    assert 0 < clock.seconds <= seconds["end"]


def test_training_on_cuda_synchronises_the_clock_once_per_optimizer_step(tmp_path):
    """Two optimizer steps: two clock synchronisations, forward seconds within each step's."""
    from jagg_pipeline.stages import train as train_stage
    from jagg_pipeline.support.timing import ForwardClock

    clocks = []

    class Counting(ForwardClock):
        def __init__(self, device):
            super().__init__(device)
            clocks.append(self)

    config = gpu_config("flux", tmp_path, "bf16", train={"lr": 1e-4, "minibatches": 2})
    original = train_stage.ForwardClock
    train_stage.ForwardClock = Counting
    try:
        _, _, result = run_round(config, tmp_path)
    finally:
        train_stage.ForwardClock = original
    assert [clock.syncs for clock in clocks] == [2]
    for row in result.metrics:
        assert row["time"]["forward"] > 0 and row["time"]["backward"] > 0
