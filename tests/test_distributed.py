"""FSDP2 under torchrun (gloo, 2 processes): gradient sums, reduce-scatter counts, equal updates.

Each test launches subprocesses (OMP_NUM_THREADS=1, a free port, a hard timeout).
"""

import json
import subprocess

import pytest
import torch
import train_helpers
from train_helpers import (
    REPO,
    launcher,
    make_config,
    max_difference,
    policy_weights,
    run_train_command,
    subprocess_env,
    write_config,
)

from jagg_pipeline.stages.checkpoint import read_ema_state, read_optimizer_state, read_trainer_state


@pytest.mark.slow
def test_fsdp_sums_rank_gradients_and_reduces_once_per_group(tiny_sd3, tmp_path):
    """One jagg window = one reduce-scatter per parameter group; gradients are summed.

    The tiny SD3 has 2 transformer blocks (FSDP units) + the root: 3 parameter groups.
    """
    out = tmp_path / "report.json"
    command = [*launcher(2), str(REPO / "tests" / "fsdp_update_worker.py"), str(tiny_sd3), str(out)]
    result = subprocess.run(
        command, env=subprocess_env(), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    groups = report["groups"]
    assert (report["world_size"], groups) == (2, 3)
    # A jagg window of W = 4 makes ONE backward call (both endpoints stacked): one
    # reduce-scatter per group; the exact window makes 4.
    assert report["jagg_window_reduce_scatters"] == groups
    # The sequential endpoint backward (training's default): one call per endpoint.
    assert report["sequential_jagg_window_reduce_scatters"] == 2 * groups
    assert report["exact_window_reduce_scatters"] == 4 * groups
    # A whole optimizer step (2 micro-batches x a jagg window's 2 sequential endpoint calls
    # and an exact window's 2 = 8 backward calls) reduces once per group: sync only on the
    # last backward call.
    assert report["step_reduce_scatters"] == groups
    # Each rank normalises by the GLOBAL sample count and FSDP2 sums (it would average by
    # default, giving half): the sharded gradient is the one-process gradient (float64).
    assert report["max_grad"] > 1e-3
    assert report["max_grad_difference"] <= 1e-14


@pytest.mark.slow
def test_two_processes_make_the_same_update_as_one(tiny_sd3, base_rollout, tmp_path):
    """Test 1: one optimizer step under torchrun -nproc 2 equals the one-process step, in
    round 0 and in round 1 resumed from a one-process checkpoint (1 -> 2: weights, optimizer
    state and EMA re-sharded over two ranks) and from a two-process one (2 -> 1: each rank
    wrote only its shards; one process reads both).

    float64; both micro-batches in one step (one per rank under torchrun), a jagg and an
    exact window, EMA on. Tolerance: 1e-12 absolute on weights that move by ~1e-4
    (summation order differs between the runs, nothing else). Adam's first step hardly
    depends on the gradient's scale, so the gradient norm and Adam's first moment are
    compared too: averaged instead of summed rank gradients would halve them.
    """
    config = make_config(
        tiny_sd3,
        jagg={"window": 4, "jagg_frac": 0.5},
        train={"ema_decay": 0.9, "lr_schedule": "cosine"},
    )
    path = write_config(config, tmp_path / "config.yaml")

    def train(policy, rollout, name, nproc):
        rollouts, table = rollout
        args = ["--config", str(path), "--policy", str(policy), "--rollouts", str(rollouts)]
        out = tmp_path / name
        run_train_command([*args, "--scores", str(table), "--out", str(out)], nproc=nproc)
        return out

    one, two = train("base", base_rollout, "one", None), train("base", base_rollout, "two", 2)
    _assert_same_update(one, two, train_helpers.base_weights(tiny_sd3))
    # Round 1 from the one-process checkpoint, in one and in two processes.
    rollout = train_helpers.scored_rollout(config, tmp_path / "r1", one, round_index=1)
    one_next, two_next = train(one, rollout, "one-next", None), train(one, rollout, "two-next", 2)
    _assert_same_update(one_next, two_next, policy_weights(one))
    states = [read_trainer_state(c) for c in (one_next, two_next)]
    assert [(s.round, s.global_step, s.world_size) for s in states] == [(1, 2, 1), (1, 2, 2)]
    assert (
        max_difference(read_ema_state(one_next), read_ema_state(two_next)) <= 1e-12
        and max_difference(read_ema_state(one_next), read_ema_state(one)) > 0
    )
    # Round 1 from the two-process checkpoint, in one and in two processes.
    rollout = train_helpers.scored_rollout(config, tmp_path / "r1-two", two, round_index=1)
    from_two = [train(two, rollout, "two-one", None), train(two, rollout, "two-two", 2)]
    _assert_same_update(*from_two, policy_weights(two))
    assert max_difference(*(read_ema_state(c) for c in from_two)) <= 1e-12


def _assert_same_update(one, two, before):
    weights = [policy_weights(c) for c in (one, two)]
    assert max_difference(weights[0], {k: before[k] for k in weights[0]}) > 5e-5  # it moved
    assert max_difference(*weights) <= 1e-12
    moments = [read_optimizer_state(c)["state"] for c in (one, two)]
    assert set(moments[0]) == set(moments[1]) == set(weights[0])
    for name in moments[0]:
        assert torch.equal(moments[0][name]["step"], moments[1][name]["step"])
        assert torch.allclose(
            moments[0][name]["exp_avg"], moments[1][name]["exp_avg"], rtol=0, atol=1e-15
        )
    metrics = [json.loads((c / "metrics.jsonl").read_text().splitlines()[0]) for c in (one, two)]
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], rel=1e-12, abs=1e-15)
    assert metrics[0]["grad_norm"] == pytest.approx(metrics[1]["grad_norm"], rel=1e-12)
    assert metrics[0]["lr"] == metrics[1]["lr"]
    # Per rank: 2 micro-batches in one process, 1 each under torchrun.
    assert [m["micro_batches_per_rank"] for m in metrics] == [2, 1]


@pytest.mark.slow
@pytest.mark.parametrize("training", ["lora", "full"])
def test_two_processes_are_reproducible_and_make_the_one_process_update(
    training, tiny_sd3, tmp_path
):
    """Under torchrun -nproc 2, two runs give byte-identical checkpoints, and the trained
    weights equal the one-process run's to summation order (float64)."""
    config = make_config(tiny_sd3, backbone={"training": training, "lora": {"rank": 2}})
    rollouts, table = train_helpers.scored_rollout(config, tmp_path / "r0")
    path = write_config(config, tmp_path / "config.yaml")
    args = ["--config", str(path), "--policy", "base", "--rollouts", str(rollouts)]
    args += ["--scores", str(table)]
    outs = {}
    for name, nproc in (("two-a", 2), ("two-b", 2), ("one", None)):
        outs[name] = tmp_path / name
        run_train_command([*args, "--out", str(outs[name])], nproc=nproc)
    train_helpers.assert_same_checkpoint(outs["two-b"], outs["two-a"])
    one, two = policy_weights(outs["one"]), policy_weights(outs["two-a"])
    assert set(one) == set(two) and all(("lora_" in k) == (training == "lora") for k in one)
    assert max_difference(one, two) <= 1e-12
