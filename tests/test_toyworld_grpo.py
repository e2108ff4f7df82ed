"""GRPO on the toy world raises the training reward, with the exact gradient and with JAGG."""

import statistics
import subprocess
import sys

import pytest
import yaml
from conftest import toy_experiment

from jagg_pipeline.config import from_mapping
from jagg_pipeline.loop import run_rounds

ROUNDS = 12


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """Two fixed captions, so a dozen rounds concentrate on what they ask for."""
    path = tmp_path_factory.mktemp("grpo") / "prompts.txt"
    path.write_text(
        "a red circle on the left, white background\na blue square at the top, black background\n"
    )
    return path


def config(world, **sections):
    small = {
        # Noise on the first 4 of 10 steps only (the rest ODE): where GRPO helps the toy world.
        "sampler": {
            "group_size": 8,
            "prompts_per_round": 2,
            "batch_size": 16,
            "window_size": 4,
            "window_start": [0, 0],
        },
        "grpo": {"clip_range": 1e-3},
        "train": {"lr": 3e-4},
    }
    for name, values in sections.items():
        small.setdefault(name, {}).update(values)
    return from_mapping(toy_experiment(world, **small))


@pytest.fixture(scope="module")
def base_spread(toy_world, prompts, tmp_path_factory):
    """Mean and seed-to-seed std of the base policy's mean training reward."""
    work = tmp_path_factory.mktemp("spread")
    means = [
        run_rounds(config(toy_world, train={"seed": s}), work / str(s), rounds=0, prompts=prompts)[
            0
        ].reward_mean
        for s in range(4)
    ]
    return statistics.mean(means), statistics.stdev(means)


@pytest.mark.parametrize("mode", ["exact", "jagg"])
def test_a_dozen_rounds_raise_the_reward_beyond_the_base_spread(
    toy_world, prompts, base_spread, mode, tmp_path
):
    base_mean, base_std = base_spread
    rounds = run_rounds(
        config(toy_world, jagg={"mode": mode}), tmp_path, rounds=ROUNDS, prompts=prompts
    )
    late = statistics.mean(r.reward_mean for r in rounds[ROUNDS // 2 :])
    assert base_std > 0
    assert late - base_mean > base_std, (mode, base_mean, base_std, [r.reward_mean for r in rounds])


def test_stage_commands_load_the_toy_checkpoint_in_a_fresh_process(toy_world, tmp_path):
    """Each stage is its own process: the toy codec must load without being imported first."""
    path = tmp_path / "experiment.yaml"
    small = {"sampler": {"prompts_per_round": 1, "group_size": 2, "batch_size": 2}}
    path.write_text(yaml.safe_dump(toy_experiment(toy_world, **small)))
    argv = ["rollout", "--config", str(path), "--policy", "base", "--prompts", "toy:heldout"]
    result = subprocess.run(
        [sys.executable, "-m", "jagg_pipeline", *argv, "--out", str(tmp_path / "rollout")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
