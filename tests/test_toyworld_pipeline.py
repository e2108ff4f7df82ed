"""The toy world end to end: its report shows headroom, and the stages run on it from the CLI."""

import json

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import toy_experiment

from jagg_pipeline.cli import main


@pytest.mark.slow
def test_base_policy_sits_between_random_init_and_the_data(toy_world):
    _, report = toy_world
    random_init = report["random_init"]["attribute_reward"]
    base = report["base_policy"]["attribute_reward"]
    real = report["data"]["attribute_reward"]
    assert random_init < 0.15 and real > 0.98
    # Seed 0 measured 0.38 (target 0.3-0.7); pretraining is chaotic, so rounding on another
    # machine moves it: seeds 0 and 1 of a shorter build gave 0.41 and 0.66.
    assert 0.2 < base < 0.85, report["base_policy"]
    assert base > random_init + 0.15, report["base_policy"]
    assert report["base_policy"]["toy_clipscore"] > report["random_init"]["toy_clipscore"] + 10
    assert report["clip"]["top1_16"] > 0.5


@pytest.mark.slow
def test_rollout_score_evaluate_on_the_toy_world_from_the_cli(toy_world, tmp_path):
    config = tmp_path / "experiment.yaml"
    small = {
        "sampler": {"prompts_per_round": 2, "group_size": 4, "batch_size": 8},
        "eval": {"max_prompts": 4, "samples_per_prompt": 1, "num_steps": 10},
    }
    config.write_text(yaml.safe_dump(toy_experiment(toy_world, **small)))
    rollout, scores, evaluation = (
        tmp_path / "rollout",
        tmp_path / "scores",
        tmp_path / "eval",
    )
    base = ["--config", str(config)]
    main(["rollout", *base, "--policy", "base", "--prompts", "toy:train", "--out", str(rollout)])
    main(["score", *base, "--rollouts", str(rollout), "--out", str(scores)])
    main(["evaluate", *base, "--policy", "base", "--out", str(evaluation)])

    table = pq.read_table(scores / "scores.parquet").to_pylist()
    assert len(table) == 8 and all(0.0 <= row["toy_attributes"] <= 1.0 for row in table)
    metrics = json.loads((evaluation / "metrics.json").read_text())
    assert set(metrics["metrics"]) == {"toy_attributes", "toy_clipscore"}
    assert (evaluation / "grid.png").is_file()
