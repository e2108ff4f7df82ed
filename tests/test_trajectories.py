import pytest
import torch

from jagg_pipeline.errors import InputError
from jagg_pipeline.trajectories import TrajectoryBatch, concatenate, load_rollout


def batch(n=4, steps=5, offset=0):
    g = torch.Generator().manual_seed(offset)
    return TrajectoryBatch(
        latents=torch.randn(n, steps + 1, 3, 4, 4, generator=g),
        log_probs=torch.randn(n, steps, generator=g),
        sigmas=torch.linspace(1, 0, steps + 1),
        sde_mask=torch.tensor([True, True, False, False, False]),
        train_mask=torch.tensor([True, True, False, False, False]),
        prompt_ids=torch.arange(n) // 2,
        group_ids=torch.arange(n) // 2 + offset,
        seeds=torch.arange(n) + offset,
        prompts=["a", "b"],
        cond={"prompt_embeds": torch.randn(n, 7, 8, generator=g)},
        images=torch.randint(0, 255, (n, 3, 8, 8), generator=g, dtype=torch.uint8),
    )


def test_shards_round_trip_and_concatenate_in_rank_order(tmp_path):
    first, second = batch(offset=0), batch(offset=10)
    second.save(tmp_path, rank=1)
    first.save(tmp_path, rank=0)
    loaded = load_rollout(tmp_path)
    expected = concatenate([first, second])
    for name in ("latents", "log_probs", "group_ids", "seeds", "images"):
        assert torch.equal(getattr(loaded, name), getattr(expected, name)), name
    assert torch.equal(loaded.cond["prompt_embeds"], expected.cond["prompt_embeds"])
    assert loaded.trained_steps == [0, 1] and len(loaded) == 8
    part = loaded.select([1, 5])
    assert torch.equal(part.seeds, torch.tensor([1, 11]))


def test_inconsistent_batches_and_rollouts_are_refused(tmp_path):
    good = batch()
    with pytest.raises(ValueError, match="latents"):
        TrajectoryBatch(**{**good.__dict__, "latents": good.latents[:, :3]})
    other = batch()
    other.prompts = ["x", "y"]
    with pytest.raises(ValueError, match="disagree"):
        concatenate([good, other])
    with pytest.raises(InputError, match="no shard"):
        load_rollout(tmp_path)
    good.save(tmp_path, rank=1)
    with pytest.raises(InputError, match=r"shards \[1\] are not 0..0"):
        load_rollout(tmp_path)
