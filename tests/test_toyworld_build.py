"""The toy world build: artifacts load through the real code paths, builds are deterministic."""

import json

import pytest
import torch
from safetensors.torch import load_file

from jagg_pipeline.backbones import BackboneConfig, load_backbone
from jagg_pipeline.rewards import load_reward, parse_spec
from jagg_pipeline.rewards import toy_scene as data
from jagg_pipeline.toyworld.build import (
    build_toyworld,
    pretrain_backbone,
    sample_images,
    staged_folder,
)
from jagg_pipeline.toyworld.config import (
    TOY_FAMILIES,
    BuildConfig,
    PretrainConfig,
    ToyClipConfig,
)
from jagg_pipeline.toyworld.models import toy_backbone_options
from jagg_pipeline.toyworld.text import vocabulary, word_tokenizer


def quick(family="sd3", seed=0, steps=6):
    return BuildConfig(
        family=family,
        seed=seed,
        pretrain=PretrainConfig(steps=steps, batch=4, warmup=2),
        clip=ToyClipConfig(steps=4, batch=8, seed=seed),
        eval_steps=3,
        eval_per_caption=1,
    )


@pytest.fixture(scope="module")
def quick_world(tmp_path_factory):
    out = tmp_path_factory.mktemp("toyworld")
    return out, build_toyworld(out, quick(), progress=False)


def test_word_tokenizers_cover_every_caption_without_unknowns():
    vocab = vocabulary()
    for role in ("clip", "t5"):
        tok = word_tokenizer(role)
        for attributes in data.ALL_ATTRIBUTES:
            ids = tok(attributes.caption()).input_ids
            assert vocab["<unk>"] not in ids and len(ids) <= tok.model_max_length
        assert tok("a red circle").input_ids[-1] == vocab["<eos>"]
    assert word_tokenizer("clip")("red").input_ids[0] == vocab["<bos>"]


def test_build_writes_report_pictures_and_loadable_artifacts(quick_world):
    out, report = quick_world
    for name in ("report-sd3.json", "samples-sd3.png", "loss-sd3.png", "clip/loss.png"):
        assert (out / name).is_file(), name
    assert json.loads((out / "report-sd3.json").read_text()) == json.loads(json.dumps(report))
    for group in ("random_init", "base_policy", "data"):
        assert set(report[group]) == {"attribute_reward", "toy_clipscore"}
    assert report["data"]["attribute_reward"] > 0.98
    assert 0.0 <= report["clip"]["top1_16"] <= 1.0

    # The checkpoint loads through the ordinary adapter path and samples images.
    backbone = load_backbone(BackboneConfig(path=str(out / "sd3"), **toy_backbone_options("sd3")))
    images = sample_images(backbone, ["a red circle on the left, white background"], 3, 0)
    assert images.shape == (1, 3, 32, 32) and images.dtype == torch.uint8

    # The rewards load through the registry: the toy CLIP through the CLIPScore code path.
    batch = data.sample_batch(6, torch.Generator().manual_seed(0), data.split()[1])
    pixels = batch.images.float() / 255
    attributes = load_reward("toy_attributes")(pixels, batch.captions)
    assert torch.all(attributes > 0.98)
    clip = load_reward("toy_clipscore", parse_spec("toy_clipscore", {"model": str(out / "clip")}))
    scores = clip(pixels, batch.captions)
    assert scores.shape == (6,) and torch.all((scores >= 0) & (scores <= 100))


def test_a_missing_toy_clip_fails_naming_its_key(tmp_path):
    spec = parse_spec("toy_clipscore", {"model": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match=r"rewards\.toy_clipscore\.model"):
        load_reward("toy_clipscore", spec)


def test_same_seed_gives_bit_identical_weights(quick_world, tmp_path):
    out, _ = quick_world
    build_toyworld(tmp_path, quick(), progress=False)
    for part in ("transformer", "text_encoder", "text_encoder_3"):
        first = load_file(next((out / "sd3" / part).glob("*.safetensors")))
        again = load_file(next((tmp_path / "sd3" / part).glob("*.safetensors")))
        assert first.keys() == again.keys()
        assert all(torch.equal(first[k], again[k]) for k in first), part
    first = load_file(out / "clip" / "model.safetensors")
    again = load_file(tmp_path / "clip" / "model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = tmp_path / "other-seed"
    build_toyworld(other, quick(seed=1), progress=False)
    a = load_file(next((out / "sd3" / "transformer").glob("*.safetensors")))
    b = load_file(next((other / "sd3" / "transformer").glob("*.safetensors")))
    assert any(not torch.equal(a[k], b[k]) for k in a)


def _without_seconds(report):
    """A report without its timings (the one part two builds do not share)."""
    if isinstance(report, dict):
        return {k: _without_seconds(v) for k, v in report.items() if k != "seconds"}
    return report


def test_a_build_finished_from_its_pretraining_writes_the_same_files(quick_world, tmp_path):
    # The workflow's split: pretraining first (no CLIP yet), then the build finishes from it.
    out, _ = quick_world
    staged = pretrain_backbone(tmp_path, quick(), progress=False)
    assert staged == staged_folder(tmp_path, "sd3") and not (tmp_path / "sd3").exists()
    build_toyworld(tmp_path, quick(), progress=False)
    assert staged.is_dir()  # the pretraining's folder belongs to whoever made it
    files, again = (
        sorted(p.relative_to(root) for p in (root / "sd3").rglob("*") if p.is_file())
        for root in (out, tmp_path)
    )
    assert files == again
    for name in [f for f in files if f.name != "manifest.json"] + [
        "samples-sd3.png",
        "loss-sd3.png",
    ]:
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name
    for name in ("report-sd3.json", "sd3/manifest.json"):
        first, again = (json.loads((root / name).read_text()) for root in (out, tmp_path))
        assert _without_seconds(first) == _without_seconds(again), name


@pytest.mark.parametrize("family", [f for f in TOY_FAMILIES if f != "sd3"])
def test_every_family_builds_and_loads_through_its_adapter(family, tmp_path):
    report = build_toyworld(tmp_path, quick(family, steps=2), progress=False)
    assert report["family"] == family
    spec = BackboneConfig(path=str(tmp_path / family), **toy_backbone_options(family))
    backbone = load_backbone(spec)
    images = sample_images(backbone, ["a blue square at the top, black background"], 2, 0)
    assert images.shape == (1, 3, 32, 32)


def test_grid_captions_keep_the_score_lines_when_prompts_are_long():
    from jagg_pipeline.io.figures import _caption_lines, image_grid

    long = "a very long prompt " * 10 + "\nscore=1\nother=2"
    lines = _caption_lines(long, 20, 4)
    assert lines[-2:] == ["score=1", "other=2"] and len(lines) == 4
    grid = image_grid(
        torch.zeros(3, 3, 8, 8, dtype=torch.uint8), ["a", "b", "c"], columns=2, cell=16
    )
    assert grid.size[0] == 2 * (16 + 4)
