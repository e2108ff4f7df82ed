"""Two ranks under ``torchrun`` sample with the FSDP2-sharded policy as one rank does.

The rollout's two shards load back as the one-rank rollout, bit for bit, and an evaluation
over two ranks writes what one process writes. ``python -m torch.distributed.run`` is
``torchrun`` from this interpreter's environment.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from stage_helpers import tiny_checkpoint, write_experiment, write_prompts
from train_helpers import torchrun

from jagg_pipeline.io.manifest import read_manifest
from jagg_pipeline.io.trajectories import load_rollout
from jagg_pipeline.stages.rollout import run_rollout

TENSORS = (
    "latents",
    "log_probs",
    "sigmas",
    "sde_mask",
    "train_mask",
    "prompt_ids",
    "group_ids",
    "seeds",
    "images",
    "sample_ids",
)


@pytest.mark.slow
@pytest.mark.parametrize("training", ["full", "lora"])
def test_two_ranks_write_two_shards_equal_to_the_one_rank_rollout(tmp_path, training):
    # QwenImage with prompts of different lengths: variable-length text is the hard case.
    # Three micro-batches on two ranks: rank 1 pads with a discarded batch (FSDP2's forwards
    # are collectives).
    checkpoint = tiny_checkpoint("qwenimage", tmp_path)
    config_file, config = write_experiment(
        tmp_path / "c.yaml", "qwenimage", checkpoint, backbone={"training": training}
    )
    prompts = write_prompts(tmp_path / "prompts.txt")
    run_rollout(config, "base", prompts, tmp_path / "one", progress=False)
    torchrun(
        "rollout",
        "--config",
        str(config_file),
        "--policy",
        "base",
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "two"),
    )

    shards = sorted(p.name for p in (tmp_path / "two").glob("shard-*.safetensors"))
    assert shards == ["shard-0.safetensors", "shard-1.safetensors"]
    manifest = read_manifest(tmp_path / "two")
    assert manifest["world_size"] == 2 and len(manifest["micro_batches"]) == 3
    # Micro-batches are dealt round-robin: rank 0 has the first and third, rank 1 the second.
    for rank, ids in ((0, [0, 1, 4, 5]), (1, [2, 3])):
        shard = load_file(str(tmp_path / "two" / f"shard-{rank}.safetensors"))
        assert shard["sample_ids"].tolist() == ids

    one, two = load_rollout(tmp_path / "one"), load_rollout(tmp_path / "two")
    for name in TENSORS:
        assert torch.equal(getattr(one, name), getattr(two, name)), name
    assert one.cond.keys() == two.cond.keys()
    assert all(torch.equal(one.cond[k], two.cond[k]) for k in one.cond)
    assert one.prompts == two.prompts
    assert not one.cond["prompt_embeds_mask"].all()  # padded text took part


@pytest.mark.slow
def test_two_ranks_evaluate_as_one_process(tmp_path):
    """Each rank samples its share with the sharded policy; rank 0 scores and writes all."""
    from jagg_pipeline.stages.evaluate import run_evaluate

    checkpoint = tiny_checkpoint("flux", tmp_path)
    config_file, config = write_experiment(tmp_path / "c.yaml", "flux", checkpoint)
    one = run_evaluate(config, "base", tmp_path / "one", progress=False)
    torchrun(
        "evaluate", "--config", str(config_file), "--policy", "base", "--out", str(tmp_path / "two")
    )
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["metrics"] == one["metrics"] and two["per_prompt"] == one["per_prompt"]
    images = sorted(p.name for p in (tmp_path / "one" / "images").glob("*.png"))
    assert images == sorted(p.name for p in (tmp_path / "two" / "images").glob("*.png"))
    for name in images:
        assert (tmp_path / "one" / "images" / name).read_bytes() == (
            tmp_path / "two" / "images" / name
        ).read_bytes(), name
