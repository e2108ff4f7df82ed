import pytest
import torch

from jagg_pipeline.io.trajectories import TrajectoryBatch, concatenate, load_rollout
from jagg_pipeline.support.errors import InputError


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


def counted_row_reads(monkeypatch) -> list[tuple[str, int]]:
    """The (tensor, rows) of every read of shard rows from now on, as they happen."""
    from jagg_pipeline.io import trajectories

    reads = []
    read_rows = trajectories._read_rows

    def counting(handle, name, rows):
        reads.append((name, len(rows)))
        return read_rows(handle, name, rows)

    monkeypatch.setattr(trajectories, "_read_rows", counting)
    return reads


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


def test_the_reader_reads_only_the_samples_asked_for(tmp_path, monkeypatch):
    """Two shards dealt round-robin (as two rollout ranks write them), velocities at a subset
    of the trained steps: any selection equals the same rows of the whole rollout, and only
    the selected rows are read from the files."""
    from jagg_pipeline.io import trajectories

    whole = batch(n=6)
    whole.velocities = torch.randn(6, 1, 3, 4, 4)
    whole.velocity_steps = [1]
    whole.sample_ids = torch.arange(6)
    whole.select([0, 1, 4, 5]).save(tmp_path, rank=0)
    whole.select([2, 3]).save(tmp_path, rank=1)
    reads = counted_row_reads(monkeypatch)
    reader = trajectories.RolloutReader(tmp_path)
    assert len(reader) == 6 and reader.trained_steps == [0, 1] and reads == []
    part = reader.select([5, 2, 0])
    expected = whole.select([5, 2, 0])
    for name in ("latents", "log_probs", "prompt_ids", "group_ids", "seeds", "velocities"):
        assert torch.equal(getattr(part, name), getattr(expected, name)), name
    assert torch.equal(part.cond["prompt_embeds"], expected.cond["prompt_embeds"])
    assert part.images is None and part.velocity_steps == [1]
    assert list(part.step_velocities()) == [1]
    assert sum(rows for name, rows in reads if name == "latents") == 3
    assert {name for name, _ in reads} == {
        "latents",
        "log_probs",
        "velocities",
        "cond.prompt_embeds",
    }
    everything = load_rollout(tmp_path)
    assert torch.equal(everything.images, whole.images)
    assert torch.equal(everything.velocities, whole.velocities)


def test_a_rollout_with_a_sample_missing_or_twice_is_refused(tmp_path):
    whole = batch(n=4)
    whole.sample_ids = torch.tensor([0, 1, 1, 3])
    whole.save(tmp_path)
    with pytest.raises(InputError, match=r"sample_ids are not 0..3"):
        load_rollout(tmp_path)


def test_the_reader_reads_images_alone(tmp_path, monkeypatch):
    """What scoring reads: the images of the samples asked for, in that order, and no other
    tensor of the shard files; a rollout without images is refused naming its folder."""
    from jagg_pipeline.io import trajectories

    whole = batch(n=6)
    whole.sample_ids = torch.arange(6)
    whole.select([0, 2, 4]).save(tmp_path, rank=0)  # dealt round-robin, as two ranks write
    whole.select([1, 3, 5]).save(tmp_path, rank=1)
    reads = counted_row_reads(monkeypatch)
    reader = trajectories.RolloutReader(tmp_path)
    images = reader.images([5, 2, 0, 3])
    assert images.dtype == torch.uint8 and torch.equal(images, whole.images[[5, 2, 0, 3]])
    assert sorted(reads) == [("images", 2), ("images", 2)]
    no_images = tmp_path / "no-images"
    whole.images = None
    whole.save(no_images)
    with pytest.raises(InputError, match=r"no-images: shard\(s\) \[0\] hold no images"):
        trajectories.RolloutReader(no_images).images([0])
