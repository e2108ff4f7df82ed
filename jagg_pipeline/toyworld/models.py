"""The toy world's checkpoints: real diffusers pipelines (SD3, Flux, QwenImage) in tiny configs.

Each toy pipeline is the family's own pipeline class with its real transformer and text-encoder
classes, the toy world's word-level tokenizers (QwenImage keeps its byte-level BPE, trained on
the toy captions, because its prompt template must cut at 34 tokens), and the lossless
:class:`~jagg_pipeline.toyworld.codec.PixelShuffleCodec` as its VAE: 32 x 32 images become
12 x 16 x 16 latents. ``save_pretrained`` writes it like any checkpoint and the backbone
adapters load it through their ordinary code path.
"""

from __future__ import annotations

from typing import Any

import torch

from jagg_pipeline.rewards.toy_scene import IMAGE_SIZE
from jagg_pipeline.toyworld.codec import PixelShuffleCodec
from jagg_pipeline.toyworld.config import TOY_FAMILIES
from jagg_pipeline.toyworld.text import MAX_LENGTH, word_tokenizer
from jagg_pipeline.toyworld.tiny import (
    SCHEDULERS,
    clip_text_config,
    qwen2_tokenizer,
    qwen_text_encoder,
    t5_encoder,
)

LATENT_CHANNELS = 12  # 3 colour channels x 2 x 2 pixels
LATENT_SIZE = IMAGE_SIZE // 2
TEXT_WIDTH = 64  # every text encoder's width; also the transformers' joint attention width
HEADS, HEAD_DIM = 2, 32  # transformer width 64


def _sd3(heads: int, head_dim: int) -> Any:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    clip, clip_2, t5 = word_tokenizer("clip"), word_tokenizer("clip"), word_tokenizer("t5")
    # SD3 pads the two CLIP sequences (32 + 32 wide) to the T5 width (64) and concatenates
    # their pooled outputs (32 + 32) into the pooled projection.
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULERS["sd3"]),
        vae=PixelShuffleCodec(),
        text_encoder=CLIPTextModelWithProjection(clip_text_config(clip, 32, 32)),
        tokenizer=clip,
        text_encoder_2=CLIPTextModelWithProjection(clip_text_config(clip_2, 32, 32)),
        tokenizer_2=clip_2,
        text_encoder_3=t5_encoder(len(t5), TEXT_WIDTH),
        tokenizer_3=t5,
        transformer=SD3Transformer2DModel(
            sample_size=LATENT_SIZE,
            patch_size=2,
            in_channels=LATENT_CHANNELS,
            out_channels=LATENT_CHANNELS,
            num_layers=4,
            attention_head_dim=head_dim,
            num_attention_heads=heads,
            joint_attention_dim=TEXT_WIDTH,
            caption_projection_dim=heads * head_dim,
            pooled_projection_dim=64,
            pos_embed_max_size=LATENT_SIZE,
        ),
    )


def _flux(heads: int, head_dim: int) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    clip, t5 = word_tokenizer("clip"), word_tokenizer("t5")
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULERS["flux"]),
        vae=PixelShuffleCodec(),
        text_encoder=CLIPTextModel(clip_text_config(clip, 32, 32)),
        tokenizer=clip,
        text_encoder_2=t5_encoder(len(t5), TEXT_WIDTH),
        tokenizer_2=t5,
        transformer=FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * LATENT_CHANNELS,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=head_dim,
            num_attention_heads=heads,
            joint_attention_dim=TEXT_WIDTH,
            pooled_projection_dim=32,
            guidance_embeds=False,
            axes_dims_rope=rope_axes(head_dim),
        ),
    )


def _qwenimage(heads: int, head_dim: int) -> Any:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    tokenizer = qwen2_tokenizer()
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULERS["qwenimage"]),
        vae=PixelShuffleCodec(),
        text_encoder=qwen_text_encoder(tokenizer, TEXT_WIDTH),
        tokenizer=tokenizer,
        transformer=QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * LATENT_CHANNELS,
            out_channels=LATENT_CHANNELS,
            num_layers=3,
            attention_head_dim=head_dim,
            num_attention_heads=heads,
            joint_attention_dim=TEXT_WIDTH,
            axes_dims_rope=rope_axes(head_dim),
        ),
    )


_BUILDERS = {"sd3": _sd3, "flux": _flux, "qwenimage": _qwenimage}


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Rotary dims per axis (text, height, width) summing to ``head_dim``: (8, 12, 12) at 32."""
    frame = head_dim // 4
    return frame, (head_dim - frame) // 2, head_dim - frame - (head_dim - frame) // 2


def build_toy_pipeline(
    family: str, seed: int = 0, heads: int = HEADS, head_dim: int = HEAD_DIM
) -> Any:
    """A randomly initialised toy pipeline of ``family``, deterministic from ``seed``.

    ``heads`` x ``head_dim`` is the transformer's width (the toy world's 2 x 32; the speed
    benchmark's wider Flux is 4 x 64).
    """
    if family not in _BUILDERS:
        raise ValueError(f"unknown toy backbone family {family!r}; choose from {TOY_FAMILIES}")
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return _BUILDERS[family](heads, head_dim)
    finally:
        torch.random.set_rng_state(state)


def toy_backbone_options(family: str) -> dict[str, Any]:
    """The ``backbone`` config values that fit a toy checkpoint of ``family``."""
    return {
        "family": family,
        "height": IMAGE_SIZE,
        "width": IMAGE_SIZE,
        "dtype": "float32",
        "training": "full",
        "max_sequence_length": MAX_LENGTH if family != "qwenimage" else 64,
    }
