"""Reward models are built straight from their weights: no random initialisation, same scores.

The HPS loader builds open_clip on the meta device and assigns the checkpoint; its scores must
be bit-identical to the former path (open_clip's randomly initialised model, the weights copied
in, then cast), computed here independently. While loading, every ``torch.nn.init`` function
raises on a real (non-meta) tensor and the global RNG must not move; the former path trips
that guard, so the guard can fail. transformers' ``from_pretrained`` (PickScore, CLIPScore,
the toy CLIP) is held to the same guard.
"""

from contextlib import contextmanager

import pytest
import torch
from reward_models import COLOURS, IMAGE_SIZE, OPEN_CLIP_ARCH, caption, colour_images, tiny_models

from jagg_pipeline.rewards import load_reward, parse_spec
from jagg_pipeline.rewards.hpsv21 import OpenClipScorer, hpsv21, load_open_clip

NAMES = list(COLOURS)
INIT_FUNCTIONS = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]


class InitRan(AssertionError):
    """A torch.nn.init function ran on a tensor with real storage."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.getbasetemp())


@contextmanager
def no_init(monkeypatch):
    """Every torch.nn.init function raises on a non-meta tensor; the RNG must not move."""

    def guarded(name, original):
        def run(*args, **kwargs):
            tensor = args[0] if args else kwargs["tensor"]
            if not tensor.is_meta:
                raise InitRan(f"torch.nn.init.{name} ran on a {tuple(tensor.shape)} tensor")
            return original(*args, **kwargs)

        return run

    with monkeypatch.context() as patch:
        for name in INIT_FUNCTIONS:
            patch.setattr(torch.nn.init, name, guarded(name, getattr(torch.nn.init, name)))
        rng = torch.get_rng_state()
        yield
        assert torch.equal(rng, torch.get_rng_state()), "loading drew random numbers"


def random_init_then_load(checkpoint, dtype):
    """The former HPS path: open_clip's random init, weights copied in, then cast."""
    import open_clip

    model = open_clip.create_model(OPEN_CLIP_ARCH, pretrained=None)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["state_dict"])
    model.to(dtype=dtype).eval().requires_grad_(False)
    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    tokenizer = open_clip.get_tokenizer(OPEN_CLIP_ARCH)
    return OpenClipScorer(model, tokenizer, IMAGE_SIZE, mean, std)


@pytest.mark.parametrize(
    ("stored", "dtype"),
    [
        ("float32", "float32"),
        ("float32", "bfloat16"),
        ("float16", "float32"),  # the released HPS v2.1 file stores float16
        ("float16", "bfloat16"),
    ],
)
def test_hps_from_weights_is_bit_identical_to_random_init_then_load(
    models, tmp_path, monkeypatch, stored, dtype
):
    checkpoint = tmp_path / "hps.pt"
    state = torch.load(models.hps_checkpoint, weights_only=True)["state_dict"]
    torch.save(
        {"state_dict": {k: v.to(getattr(torch, stored)) for k, v in state.items()}}, checkpoint
    )
    spec = parse_spec(
        "hpsv21", {"checkpoint": str(checkpoint), "arch": str(models.hps_arch_json), "dtype": dtype}
    )
    with no_init(monkeypatch):
        ours = load_open_clip(spec, torch.device("cpu"))
    reference = random_init_then_load(checkpoint, getattr(torch, dtype))
    # every tensor, the rebuilt causal mask (not in the checkpoint) included, equal bit for bit
    ours_tensors = dict(ours.model.named_parameters()) | dict(ours.model.named_buffers())
    theirs = dict(reference.model.named_parameters()) | dict(reference.model.named_buffers())
    assert "attn_mask" in ours_tensors and ours_tensors.keys() == theirs.keys()
    for name, tensor in ours_tensors.items():
        assert tensor.dtype == theirs[name].dtype and tensor.device.type == "cpu", name
        assert torch.equal(tensor, theirs[name]), name
    assert not ours.model.training and not any(p.requires_grad for p in ours.model.parameters())
    images = colour_images(NAMES, seed=7)
    for prompt in [caption("red"), "a photo of an astronaut riding a horse"]:
        prompts = [prompt] * len(NAMES)
        expected = hpsv21(reference, images, prompts)
        assert torch.equal(hpsv21(ours, images, prompts), expected)
        assert torch.equal(load_reward("hpsv21", spec)(images, prompts), expected.float())


def test_the_init_guard_catches_random_init(models, monkeypatch):
    with pytest.raises(InitRan), no_init(monkeypatch):
        random_init_then_load(models.hps_checkpoint, torch.float32)


def test_transformers_clip_loads_without_init_onto_the_device(models, monkeypatch):
    from transformers import CLIPModel

    spec = parse_spec("clipscore", {"model": str(models.hf_clip_dir), "dtype": "bfloat16"})
    with no_init(monkeypatch):
        reward = load_reward("clipscore", spec)
    (model,) = reward.modules
    saved = CLIPModel.from_pretrained(models.hf_clip_dir)
    loaded = model.state_dict()
    assert loaded.keys() == saved.state_dict().keys()
    for name, tensor in saved.state_dict().items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(loaded[name], want) and loaded[name].device.type == "cpu", name
