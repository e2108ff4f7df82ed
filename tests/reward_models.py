"""Tiny reward models in their real on-disk formats, trained to know colours (test helper).

Two tiny CLIPs, each trained contrastively for a few seconds on solid-colour images with
captions "a <colour> image" so that a matching caption really scores higher than a
mismatched one (the open_clip model's untrained weights are saved too, as a control that
fails the ordering):
- an open_clip CLIP from a custom model config, saved as HPS v2.1 is distributed
  (``torch.save({"state_dict": ...})``), with the real CLIP BPE tokenizer of open_clip;
- a transformers ``CLIPModel`` + ``CLIPProcessor`` saved with ``save_pretrained``; the
  tokenizer is the real CLIP BPE vocabulary rebuilt offline from open_clip's bundled file.
Both are built once per session under pytest's base temp dir.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

COLOURS = {
    "red": (0.85, 0.1, 0.1),
    "green": (0.1, 0.75, 0.15),
    "blue": (0.1, 0.2, 0.85),
    "yellow": (0.9, 0.85, 0.1),
}
IMAGE_SIZE = 32
OPEN_CLIP_ARCH = "jagg-tiny-hps-test"
OPEN_CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": IMAGE_SIZE, "layers": 1, "width": 32, "head_width": 16,
                   "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}  # fmt: skip


def caption(colour: str) -> str:
    return f"a {colour} image"


def colour_images(names: list[str], size: int = IMAGE_SIZE, seed: int = 0) -> torch.Tensor:
    """Float [0, 1] images [B, 3, size, size] of the named colours with mild pixel noise."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.tensor([COLOURS[n] for n in names]).view(-1, 3, 1, 1)
    noise = 0.08 * torch.randn(len(names), 3, size, size, generator=gen)
    return (base + noise).clamp(0, 1)


def _clip_loss(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
    image = F.normalize(image_features, dim=-1)
    text = F.normalize(text_features, dim=-1)
    logits = 10.0 * image @ text.T
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _train(image_fn, text_fn, params, steps: int = 120) -> None:
    """Contrastive training on one batch per step: each colour once, fresh noise every step."""
    names = list(COLOURS)
    optimizer = torch.optim.Adam(params, lr=3e-3)
    for step in range(steps):
        loss = _clip_loss(image_fn(colour_images(names, seed=step)), text_fn(names))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@dataclass(frozen=True)
class TinyModels:
    hps_checkpoint: Path
    hps_checkpoint_untrained: Path
    hps_arch_json: Path
    hf_clip_dir: Path


def _build_open_clip(root: Path) -> tuple[Path, Path, Path]:
    import open_clip

    from jagg_pipeline.rewards.hpsv21 import hps_preprocess

    arch_json = root / f"{OPEN_CLIP_ARCH}.json"
    arch_json.write_text(json.dumps(OPEN_CLIP_CONFIG))
    open_clip.add_model_config(arch_json)
    torch.manual_seed(0)
    model = open_clip.create_model(OPEN_CLIP_ARCH, pretrained=None)
    tokenizer = open_clip.get_tokenizer(OPEN_CLIP_ARCH)
    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    untrained = root / "untrained.pt"
    torch.save({"state_dict": model.state_dict()}, untrained)
    _train(
        lambda x: model.encode_image(hps_preprocess(x, IMAGE_SIZE, mean, std)),
        lambda names: model.encode_text(tokenizer([caption(n) for n in names])),
        model.parameters(),
    )
    checkpoint = root / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    return checkpoint, untrained, arch_json


def _build_hf_clip(root: Path) -> Path:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from jagg_pipeline.rewards.clip import HFClip
    from jagg_pipeline.toyworld.tiny import clip_tokenizer

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
    torch.manual_seed(0)
    model = CLIPModel(config)

    clip = HFClip(model=model, processor=processor)
    _train(clip.image_features, lambda names: clip.text_features([caption(n) for n in names]),
           model.parameters())  # fmt: skip
    out = root / "tiny-clip"
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@functools.cache
def tiny_models(root: Path) -> TinyModels:
    """Build both tiny models once per session (``root``: pytest's base temp dir)."""
    root = root / "tiny-reward-models"
    root.mkdir(exist_ok=True)
    checkpoint, untrained, arch_json = _build_open_clip(root)
    return TinyModels(
        hps_checkpoint=checkpoint,
        hps_checkpoint_untrained=untrained,
        hps_arch_json=arch_json,
        hf_clip_dir=_build_hf_clip(root),
    )
