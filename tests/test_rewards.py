import io
import json
import time

import pytest
import torch
from PIL import Image
from reward_models import COLOURS, OPEN_CLIP_CONFIG, caption, colour_images, tiny_models

from jagg_pipeline.config.fields import to_dict
from jagg_pipeline.core.grpo import group_advantages
from jagg_pipeline.rewards import (
    REWARDS,
    MultiReward,
    RewardConfigError,
    combine_rewards,
    load_reward,
    parse_rewards,
    parse_spec,
    to_unit_float,
)

NAMES = list(COLOURS)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.getbasetemp())


def hps_spec(models, checkpoint=None):
    checkpoint = checkpoint or models.hps_checkpoint
    return parse_spec("hpsv21", {"checkpoint": str(checkpoint), "arch": str(models.hps_arch_json)})


def hf_spec(name, models, **extra):
    return parse_spec(name, {"model": str(models.hf_clip_dir), **extra})


def score_matrix(reward, seed=123):
    """scores[i, j] = reward(image of colour i, caption of colour j), on unseen noise."""
    images = colour_images(NAMES, seed=seed)
    return torch.stack([reward(images, [caption(c)] * len(NAMES)) for c in NAMES], dim=1)


def assert_matching_caption_wins(scores):
    diagonal = scores.diagonal()
    off = scores.masked_fill(torch.eye(len(scores), dtype=torch.bool), float("-inf"))
    assert (diagonal > off.max(dim=1).values).all(), scores


def test_registry_has_the_issue_rewards():
    assert {"hpsv21", "pickscore", "clipscore", "jpeg_compressibility"} <= set(REWARDS)
    for info in REWARDS.values():
        info.spec_type()  # every field has a default
        assert info.summary


def test_hpsv21_real_format_range_and_ordering(models):
    reward = load_reward("hpsv21", hps_spec(models))
    scores = score_matrix(reward)
    assert scores.dtype == torch.float32
    assert (scores.abs() <= 1 + 1e-6).all()  # a cosine, no logit scale
    assert_matching_caption_wins(scores)
    # control: the same architecture untrained does not order the captions
    untrained = load_reward("hpsv21", hps_spec(models, models.hps_checkpoint_untrained))
    with pytest.raises(AssertionError):
        assert_matching_caption_wins(score_matrix(untrained))


def test_pickscore_is_scaled_cosine_by_hand(models):
    from transformers import CLIPModel, CLIPProcessor

    reward = load_reward(
        "pickscore", hf_spec("pickscore", models, processor=str(models.hf_clip_dir))
    )
    scores = score_matrix(reward)
    assert_matching_caption_wins(scores)
    # independent computation: PIL images through the saved processor and model
    model = CLIPModel.from_pretrained(models.hf_clip_dir)
    processor = CLIPProcessor.from_pretrained(models.hf_clip_dir)
    images = colour_images(NAMES, seed=7)
    prompts = [caption(c) for c in reversed(NAMES)]
    pil = [Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy()) for x in images]
    inputs = processor(text=prompts, images=pil, return_tensors="pt", padding=True, truncation=True)
    with torch.no_grad():
        out = model(**inputs)
    expected = out.logits_per_image.diagonal()  # exp(logit_scale) * cos, computed by transformers
    torch.testing.assert_close(reward(images, prompts), expected, atol=1e-4, rtol=1e-5)
    scale = float(model.logit_scale.detach().exp())
    assert (scores.abs() <= scale + 1e-4).all()


def test_clipscore_equals_torchmetrics(models):
    tm = pytest.importorskip("torchmetrics.functional.multimodal")
    from torchmetrics.multimodal import CLIPScore
    from transformers import CLIPModel, CLIPProcessor

    reward = load_reward("clipscore", hf_spec("clipscore", models))
    scores = score_matrix(reward)
    assert_matching_caption_wins(scores)
    assert ((scores >= 0) & (scores <= 100)).all() and (scores == 0).any()  # clamped at 0

    model = CLIPModel.from_pretrained(models.hf_clip_dir)
    processor = CLIPProcessor.from_pretrained(models.hf_clip_dir)

    class Features:
        """torchmetrics 1.9 expects tensors from get_*_features; transformers 5 returns outputs."""

        config = model.config

        def to(self, device):
            return self

        def get_image_features(self, *args, **kwargs):
            return model.get_image_features(*args, **kwargs).pooler_output

        def get_text_features(self, *args, **kwargs):
            return model.get_text_features(*args, **kwargs).pooler_output

    gen = torch.Generator().manual_seed(3)
    # uint8 images as torchmetrics expects, at a size the processor must resize and crop
    images = torch.randint(0, 256, (4, 3, 40, 56), generator=gen, dtype=torch.uint8)
    images[:2] = (colour_images(["red", "blue"], size=56)[:, :, :40] * 255).round().byte()
    prompts = [caption("red"), caption("green"), caption("blue"), "a photo of a cat"]
    ours = reward(to_unit_float(images), prompts)
    with torch.no_grad():
        per_pair = torch.stack(
            [
                tm.clip_score(images[i], prompts[i], lambda: (Features(), processor))
                for i in range(4)
            ]
        )
        metric = CLIPScore(model_name_or_path=lambda: (Features(), processor))
        metric.update(images[:1], prompts[:1])
        metric.update(images[2:3], prompts[2:3])
        batch_mean = metric.compute()
    torch.testing.assert_close(ours, per_pair, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(batch_mean, ours[[0, 2]].mean(), atol=1e-4, rtol=1e-5)


def test_jpeg_compressibility_by_hand():
    reward = load_reward("jpeg_compressibility")
    gen = torch.Generator().manual_seed(0)
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64, generator=gen)
    scores = reward(torch.cat([flat, noise]), ["x", "y"])
    assert (scores <= 0).all() and scores[0] > scores[1]
    buffer = io.BytesIO()
    array = (noise[0] * 255).round().byte().permute(1, 2, 0).numpy()
    Image.fromarray(array).save(buffer, format="JPEG", quality=95)
    assert float(scores[1]) == pytest.approx(-len(buffer.getvalue()) / 1000, rel=1e-6)
    lower = load_reward("jpeg_compressibility", parse_spec("jpeg_compressibility", {"quality": 20}))
    assert lower(noise, ["y"])[0] > scores[1]


def test_batching_dtype_and_input_checks(models):
    spec = hf_spec("clipscore", models, batch_size=1)
    one_by_one = load_reward("clipscore", spec)
    images = colour_images(NAMES, seed=1)
    prompts = [caption(c) for c in NAMES]
    whole = load_reward("clipscore", hf_spec("clipscore", models))(images, prompts)
    torch.testing.assert_close(one_by_one(images, prompts), whole, atol=1e-4, rtol=1e-5)
    bf16 = load_reward("clipscore", hf_spec("clipscore", models, dtype="bfloat16"))
    low = bf16(images.to(torch.bfloat16), prompts)
    assert low.dtype == torch.float32 and not low.requires_grad
    torch.testing.assert_close(low, whole, atol=3.0, rtol=0.05)
    with pytest.raises(TypeError, match="to_unit_float"):
        one_by_one((images * 255).byte(), prompts)
    with pytest.raises(ValueError, match="one prompt per image"):
        one_by_one(images, prompts[:2])
    with pytest.raises(RewardConfigError, match=r"rewards\.clipscore\.dtype"):
        load_reward("clipscore", hf_spec("clipscore", models, dtype="float8"))


@pytest.mark.parametrize(
    ("name", "settings", "key"),
    [
        ("hpsv21", {"checkpoint": "/no/such/HPS_v2.1_compressed.pt"}, "rewards.hpsv21.checkpoint"),
        ("hpsv21", {}, "rewards.hpsv21.checkpoint"),  # default: hub file, not cached
        ("pickscore", {"model": "/no/such/dir"}, "rewards.pickscore.model"),
        ("pickscore", {}, "rewards.pickscore.model"),  # default: hub id, not cached
        ("clipscore", {"model": "jagg-test/no-such-clip"}, "rewards.clipscore.model"),
    ],
)
def test_missing_model_fails_fast_offline_naming_the_key(name, settings, key):
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE  # set by conftest before any import
    start = time.monotonic()
    with pytest.raises(RewardConfigError) as info:
        load_reward(name, parse_spec(name, settings))
    assert time.monotonic() - start < 10.0
    message = str(info.value)
    assert message.startswith(f"{key}: ") and "not found" in message and "set it to" in message


def test_config_errors_name_the_key(models, tmp_path):
    with pytest.raises(RewardConfigError, match=r"rewards\.hpsv21\.chekpoint: unknown key"):
        parse_spec("hpsv21", {"chekpoint": "x"})
    with pytest.raises(
        RewardConfigError, match=r"rewards\.pickscore\.batch_size: expected an integer"
    ):
        parse_spec("pickscore", {"batch_size": "many"})
    with pytest.raises(RewardConfigError, match=r"rewards\.weights\.nope: unknown reward"):
        parse_rewards({"weights": {"nope": 1.0}})
    with pytest.raises(RewardConfigError, match=r"rewards\.weights: required"):
        parse_rewards({"hpsv21": {}})
    no_arch = parse_spec("hpsv21", {"checkpoint": str(models.hps_checkpoint), "arch": "ViT-Q-9"})
    with pytest.raises(RewardConfigError, match=r"rewards\.hpsv21\.arch: 'ViT-Q-9' is not"):
        load_reward("hpsv21", no_arch)
    other = tmp_path / "jagg-tiny-other.json"
    other.write_text(json.dumps({**OPEN_CLIP_CONFIG, "embed_dim": 8}))
    wrong_arch = parse_spec(
        "hpsv21", {"checkpoint": str(models.hps_checkpoint), "arch": str(other)}
    )
    with pytest.raises(RewardConfigError, match=r"rewards\.hpsv21\.checkpoint: .* does not match"):
        load_reward("hpsv21", wrong_arch)
    with pytest.raises(RewardConfigError, match=r"rewards\.clipscore\.batch_size: expected an"):
        parse_rewards({"weights": {"hpsv21": 2}, "clipscore": {"batch_size": "8"}})
    spec = parse_rewards(
        {"weights": {"hpsv21": 2}, "normalize_separately": True, "clipscore": {"batch_size": 8}}
    )
    assert spec.weights == {"hpsv21": 2.0} and spec.normalize_separately
    assert spec.spec("clipscore").batch_size == 8
    assert to_dict(spec)["hpsv21"]["arch"] == "ViT-H-14"


def test_combine_rewards_by_hand():
    a = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 40.0])
    b = torch.tensor([0.3, 0.1, 0.2, 0.5, 0.4, 0.3])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    weights = {"a": 0.5, "b": 2.0}
    joint = combine_rewards({"a": a, "b": b}, weights, groups)
    total = 0.5 * a + 2.0 * b
    torch.testing.assert_close(joint.total, total)
    by_hand = []
    for g in (0, 1):
        t = total[groups == g]
        by_hand.append((t - t.mean()) / (t.std(unbiased=False) + 1e-4))
    torch.testing.assert_close(joint.advantages, torch.cat(by_hand))
    separate = combine_rewards({"a": a, "b": b}, weights, groups, normalize_separately=True)
    expected = 0.5 * group_advantages(a, groups).values + 2.0 * group_advantages(b, groups).values
    torch.testing.assert_close(separate.advantages, expected)
    torch.testing.assert_close(separate.total, total)
    # a's large scale dominates the joint advantage but not the separately normalised one
    assert torch.sign(joint.advantages[3:]).tolist() == [-1, -1, 1]
    assert torch.sign(separate.advantages[3:]).tolist() != [-1, -1, 1]
    assert combine_rewards({"a": a}, {"a": 1.0}).advantages is None
    with pytest.raises(ValueError, match="same"):
        combine_rewards({"a": a}, weights)


def test_multi_reward_from_spec(models):
    spec = parse_rewards(
        {
            "weights": {"clipscore": 1.0, "jpeg_compressibility": 0.1},
            "clipscore": {"model": str(models.hf_clip_dir)},
        }
    )
    reward = MultiReward.from_spec(spec)
    images = colour_images(NAMES * 2, seed=4)
    prompts = [caption(c) for c in NAMES] * 2
    result = reward(images, prompts, torch.tensor([0, 1, 2, 3] * 2))
    assert set(result.columns) == {"clipscore", "jpeg_compressibility"}
    expected = result.columns["clipscore"] + 0.1 * result.columns["jpeg_compressibility"]
    torch.testing.assert_close(result.total, expected)
    assert result.advantages.shape == (8,)
