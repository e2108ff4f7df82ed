"""Tiny HPSv2.1 / PickScore / CLIPScore models in their real on-disk formats, built offline.

Owns the builders of the tiny reward models: what ``rewards --build-tiny DIR`` writes for a
researcher to try the real reward path (loading, scoring, the workflow) on a machine without
the real models, and what the tests of the real reward classes load. Each is the real
architecture in a tiny config (one layer per tower, 32-pixel images; about 1.6 million
parameters, nearly all of them the 49408-token embedding), randomly initialised from a seed,
then trained contrastively for a few seconds on solid-colour images captioned "a <colour>
image", so that a matching caption scores higher than a mismatched one. Their scores mean
nothing on real images: they are for trying the path, never for results.

- ``hpsv21``: an open_clip CLIP from a custom model config (the JSON that
  ``rewards.hpsv21.arch`` names), saved as HPS v2.1 is distributed
  (``torch.save({"state_dict": ...})`` in ``HPS_v2.1_compressed.pt``), with open_clip's real
  CLIP BPE tokenizer;
- ``pickscore``, ``clipscore``: a transformers ``CLIPModel`` + ``CLIPProcessor`` saved with
  ``save_pretrained`` in one folder, from two seeds; the tokenizer is the real CLIP BPE
  vocabulary, rebuilt offline from open_clip's bundled merges file by :func:`clip_tokenizer`
  (which the tiny diffusion backbones of :mod:`jagg_pipeline.toyworld.tiny` use too).

:func:`tiny_rewards_config` is the ``rewards`` and ``eval`` config that points at a folder of
them, laid out as :func:`build_tiny_reward` writes it.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

COLOURS = {
    "red": (0.85, 0.1, 0.1),
    "green": (0.1, 0.75, 0.15),
    "blue": (0.1, 0.2, 0.85),
    "yellow": (0.9, 0.85, 0.1),
}
IMAGE_SIZE = 32
OPEN_CLIP_ARCH = "jagg-tiny-hps"
OPEN_CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": IMAGE_SIZE, "layers": 1, "width": 32, "head_width": 16,
                   "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}  # fmt: skip
HPS_CHECKPOINT = "HPS_v2.1_compressed.pt"  # the name HPS v2.1 is distributed under
TRAIN_STEPS = 120  # enough for every colour's caption to rank first on its images

# The rewards a tiny build holds (one folder each), and the seed of each model's weights:
# pickscore and clipscore differ, as the real ones do.
TINY_REWARDS: tuple[str, ...] = ("hpsv21", "pickscore", "clipscore")
_SEEDS = {"hpsv21": 0, "pickscore": 0, "clipscore": 1}
MANIFEST = "tiny-rewards.yaml"  # the config a build writes beside its models; marks the folder


def caption(colour: str) -> str:
    """The training caption of a colour: 'a red image'."""
    return f"a {colour} image"


def colour_images(names: list[str], size: int = IMAGE_SIZE, seed: int = 0) -> torch.Tensor:
    """Float [0, 1] images [B, 3, size, size] of the named colours with mild pixel noise."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.tensor([COLOURS[n] for n in names]).view(-1, 3, 1, 1)
    noise = 0.08 * torch.randn(len(names), 3, size, size, generator=gen)
    return (base + noise).clamp(0, 1)


@functools.cache
def _clip_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary and merges from open_clip's BPE file (read once per process).

    The vocabulary is the 256 byte symbols, the same with the end-of-word mark, one token per
    merge in rank order, then the start/end-of-text tokens: the order CLIP's ids follow.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("open_clip_torch is needed to rebuild the CLIP vocabulary")
    bpe_file = Path(spec.submodule_search_locations[0]) / "bpe_simple_vocab_16e6.txt.gz"
    with gzip.open(bpe_file, "rt", encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    # The first line is a header; CLIP keeps 49152 - 256 - 2 merges.
    merges = [tuple(line.split()) for line in lines[1 : 49152 - 256 - 2 + 1]]
    symbols = list(bytes_to_unicode().values())
    tokens = [*symbols, *(s + "</w>" for s in symbols), *("".join(m) for m in merges)]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {token: index for index, token in enumerate(tokens)}, merges


def clip_tokenizer(pad_token: str = "<|endoftext|>") -> Any:
    """The real CLIP BPE tokenizer (49408 tokens), rebuilt from open_clip's merges file.

    A transformers ``CLIPTokenizer``; transformers 5 ignores ``vocab_file=``/``merges_file=``,
    so it is built from the vocabulary and merges themselves, with an explicit
    ``model_max_length``.
    """
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab()
    return CLIPTokenizer(
        vocab=dict(vocab), merges=list(merges), pad_token=pad_token, model_max_length=77
    )


def _clip_loss(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
    image = F.normalize(image_features, dim=-1)
    text = F.normalize(text_features, dim=-1)
    logits = 10.0 * image @ text.T
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _train(
    image_fn: Callable[[torch.Tensor], torch.Tensor],
    text_fn: Callable[[list[str]], torch.Tensor],
    params: Iterable[torch.nn.Parameter],
    steps: int,
) -> None:
    """Contrastive training on one batch per step: each colour once, fresh noise every step."""
    names = list(COLOURS)
    optimizer = torch.optim.Adam(params, lr=3e-3)
    for step in range(steps):
        loss = _clip_loss(image_fn(colour_images(names, seed=step)), text_fn(names))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def build_hpsv21(folder: Path, seed: int = 0, steps: int = TRAIN_STEPS) -> tuple[Path, Path]:
    """Write a tiny HPS v2.1 checkpoint and its open_clip model config into ``folder``.

    Returns ``(checkpoint, arch_json)``, the values of ``rewards.hpsv21.checkpoint`` and
    ``rewards.hpsv21.arch``. ``steps=0`` saves the untrained weights (a control whose scores
    ignore the caption).
    """
    import open_clip

    from jagg_pipeline.rewards.hpsv21 import hps_preprocess

    folder.mkdir(parents=True, exist_ok=True)
    arch_json = folder / f"{OPEN_CLIP_ARCH}.json"
    arch_json.write_text(json.dumps(OPEN_CLIP_CONFIG))
    open_clip.add_model_config(arch_json)
    torch.manual_seed(seed)
    model = open_clip.create_model(OPEN_CLIP_ARCH, pretrained=None)
    tokenizer = open_clip.get_tokenizer(OPEN_CLIP_ARCH)
    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    _train(
        lambda x: model.encode_image(hps_preprocess(x, IMAGE_SIZE, mean, std)),
        lambda names: model.encode_text(tokenizer([caption(n) for n in names])),
        model.parameters(),
        steps,
    )
    checkpoint = folder / HPS_CHECKPOINT
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    return checkpoint, arch_json


def build_hf_clip(folder: Path, seed: int = 0, steps: int = TRAIN_STEPS) -> Path:
    """Write a tiny transformers ``CLIPModel`` and its ``CLIPProcessor`` into ``folder``.

    The folder is the value of ``rewards.pickscore.model`` and ``.processor``, or of
    ``rewards.clipscore.model``; returns it.
    """
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from jagg_pipeline.rewards.clip import HFClip

    tokenizer = clip_tokenizer()
    vocab = tokenizer.get_vocab()
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    config = CLIPConfig(
        text_config={
            "vocab_size": len(vocab), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 77,
            "bos_token_id": vocab["<|startoftext|>"], "eos_token_id": vocab["<|endoftext|>"],
            "pad_token_id": vocab["<|endoftext|>"],
        },
        vision_config={
            "image_size": IMAGE_SIZE, "patch_size": 8, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        },
        projection_dim=16,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = CLIPModel(config)

    clip = HFClip(model=model, processor=processor)
    _train(clip.image_features, lambda names: clip.text_features([caption(n) for n in names]),
           model.parameters(), steps)  # fmt: skip
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def build_tiny_reward(name: str, folder: Path) -> None:
    """Write reward ``name``'s tiny model (one of :data:`TINY_REWARDS`) into ``folder``."""
    if name == "hpsv21":
        build_hpsv21(folder, seed=_SEEDS[name])
    else:
        build_hf_clip(folder, seed=_SEEDS[name])


def tiny_rewards_config(root: Path) -> dict[str, Any]:
    """The ``rewards`` and ``eval`` config sections that use the tiny models built in ``root``.

    ``root`` holds one folder per reward of :data:`TINY_REWARDS`, as :func:`build_tiny_reward`
    writes them; the paths are absolute, so the config works from any directory. HPSv2.1 and
    PickScore train with equal weights, and all three are evaluation metrics.
    """
    root = root.resolve()
    clip = {name: str(root / name) for name in ("pickscore", "clipscore")}
    return {
        "rewards": {
            "weights": {"hpsv21": 1.0, "pickscore": 1.0},
            "hpsv21": {
                "checkpoint": str(root / "hpsv21" / HPS_CHECKPOINT),
                "arch": str(root / "hpsv21" / f"{OPEN_CLIP_ARCH}.json"),
            },
            "pickscore": {"model": clip["pickscore"], "processor": clip["pickscore"]},
            "clipscore": {"model": clip["clipscore"]},
        },
        "eval": {"metrics": list(TINY_REWARDS)},
    }
