"""Tiny random Flux / SD3 / QwenImage pipelines in the real diffusers formats, built offline.

Owns the builders of the test checkpoints: every component is the real class (the family's
transformer, VAE, text encoders, tokenizers, scheduler) with a few layers and small hidden
sizes, randomly initialised from a seed, and ``save_pretrained`` writes it exactly as a hub
checkpoint is laid out. The adapters then load these directories through the same code path as
a real checkpoint, and the tests compare them with the official diffusers pipelines.

Tokenizers are made without any download: the CLIP one is
:func:`jagg_pipeline.rewards.tiny.clip_tokenizer` (the real vocabulary, rebuilt from the BPE
merges file that open_clip ships; the tiny reward models use it too); the T5 unigram
vocabulary is the toy corpus' words and characters scored by log frequency; the Qwen2
byte-level BPE is trained here with ``tokenizers`` on the toy captions and QwenImage's prompt
template. Transformers 5 ignores ``vocab_file=``/``merges_file=``, so they are built from
``vocab=``/``merges=`` objects, and each gets an explicit ``model_max_length``.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from jagg_pipeline.backbones import Backbone, load_backbone
from jagg_pipeline.backbones.qwenimage import PROMPT_TEMPLATE
from jagg_pipeline.config.run import BackboneConfig
from jagg_pipeline.rewards.tiny import clip_tokenizer
from jagg_pipeline.rewards.toy_scene import ALL_ATTRIBUTES

TINY_FAMILIES: tuple[str, ...] = ("flux", "sd3", "qwenimage")
TINY_IMAGE_SIZE = 32  # pixels; every tiny VAE downsamples by 2, so latents are 16 x 16

# QwenImagePipeline drops the first 34 tokens of its template's encoding, so the tiny Qwen2
# tokenizer must encode the part before the prompt to exactly 34 tokens (as the real one does:
# one token per word, punctuation mark and special token).
QWEN_TEMPLATE_PREFIX, QWEN_TEMPLATE_SUFFIX = PROMPT_TEMPLATE.split("{}")
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def toy_captions() -> list[str]:
    """Every caption of the toy world: 'a red circle on the left, white background'."""
    return [attributes.caption() for attributes in ALL_ATTRIBUTES]


def _corpus() -> list[str]:
    """Training text for the tiny tokenizers: the toy captions and the Qwen prompt template.

    The template is cut at its special tokens, as the tokenizer sees it.
    """
    special = "|".join(re.escape(token) for token in QWEN_SPECIAL_TOKENS)
    template = re.split(special, QWEN_TEMPLATE_PREFIX + QWEN_TEMPLATE_SUFFIX)
    return [*toy_captions(), *(piece for piece in template if piece)]


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


def t5_tokenizer(model_max_length: int = 512):
    """A T5 (SentencePiece unigram) tokenizer whose pieces are the toy corpus' words and characters.

    Each piece scores its log relative frequency, so whole words win over character splits and
    unseen words still encode (character by character).
    """
    from transformers import T5Tokenizer

    words = Counter(f"▁{word}" for text in _corpus() for word in text.split())
    chars = Counter(char for text in _corpus() for char in text if not char.isspace())
    counts = words + chars + Counter({"▁": 1})
    total = sum(counts.values())
    pieces = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]  # T5's ids 0, 1, 2
    vocab += [(piece, math.log(count / total)) for piece, count in pieces]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def qwen2_tokenizer(
    vocab_size: int = 600, model_max_length: int = 2048, corpus: Sequence[str] | None = None
):
    """A Qwen2 byte-level BPE tokenizer trained on ``corpus``, with Qwen's chat tokens.

    Trained with Qwen2's own pre-tokenizer, so every corpus word becomes one token; on the
    default corpus (toy captions and the prompt template) the QwenImage template prefix
    encodes to exactly 34 tokens.
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = Qwen2Tokenizer()._tokenizer.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[QWEN_SPECIAL_TOKENS[0]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus() if corpus is None else corpus, trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"], merges=merges, model_max_length=model_max_length
    )
    tokenizer.add_tokens([AddedToken(t, special=True) for t in QWEN_SPECIAL_TOKENS[1:]])
    return tokenizer


# --------------------------------------------------------------------------------------------
# Pipelines
# --------------------------------------------------------------------------------------------


def clip_text_config(tokenizer, hidden: int, projection: int, layers: int = 2):
    """A small CLIP text config whose special-token ids are ``tokenizer``'s.

    CLIP pools at the first end-of-text token, so ``eos_token_id`` must be the tokenizer's.
    """
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=projection,
        num_hidden_layers=layers,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )


def t5_encoder(vocab_size: int, d_model: int, layers: int = 2):
    """A small T5 encoder (relative attention, 8 buckets)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=d_model,
            d_ff=2 * d_model,
            d_kv=d_model // 2,
            num_layers=layers,
            num_heads=2,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
            # No dropout: it would draw from the global RNG while the toy world pretrains the
            # encoder, so the result would depend on whatever ran before in the process.
            dropout_rate=0.0,
        )
    )


def qwen_text_encoder(tokenizer, hidden: int, layers: int = 2):
    """A small Qwen2.5-VL (the QwenImage text encoder) over ``tokenizer``'s vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    # Multimodal rotary sections (temporal, height, width) must cover half a head's width.
    half = hidden // 2 // 2
    temporal = half // 4
    height = (half - temporal) // 2
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": [temporal, height, half - temporal - height],
        },
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": hidden,
        "patch_size": 2,
        "spatial_merge_size": 1,
        "temporal_patch_size": 1,
        "window_size": 4,
        "fullatt_block_indexes": [0],
    }
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config)
    return Qwen2_5_VLForConditionalGeneration(config)


# Each family's scheduler settings, as its released checkpoints configure them.
SCHEDULERS: dict[str, dict[str, object]] = {
    "flux": {
        "shift": 3.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
    },
    "sd3": {"shift": 3.0},
    "qwenimage": {
        "shift": 1.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 0.9,
        "base_image_seq_len": 256,
        "max_image_seq_len": 8192,
        "shift_terminal": 0.02,
        "time_shift_type": "exponential",
    },
}


def _kl_vae(scaling_factor: float, shift_factor: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=TINY_IMAGE_SIZE,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _tiny_flux():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    clip = clip_tokenizer()
    t5 = t5_tokenizer()
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULERS["flux"]),
        vae=_kl_vae(scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=CLIPTextModel(clip_text_config(clip, hidden=32, projection=32)),
        tokenizer=clip,
        text_encoder_2=t5_encoder(len(t5), d_model=48),
        tokenizer_2=t5,
        transformer=FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=48,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ),
    )


def _tiny_sd3():
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    clip = clip_tokenizer()
    clip_2 = clip_tokenizer(pad_token="!")
    t5 = t5_tokenizer()
    # Different CLIP widths (32, 40) so that swapped encoders fail loudly.
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULERS["sd3"]),
        vae=_kl_vae(scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=CLIPTextModelWithProjection(clip_text_config(clip, 32, 16)),
        tokenizer=clip,
        text_encoder_2=CLIPTextModelWithProjection(clip_text_config(clip_2, 40, 24)),
        tokenizer_2=clip_2,
        text_encoder_3=t5_encoder(len(t5), d_model=80),
        tokenizer_3=t5,
        transformer=SD3Transformer2DModel(
            sample_size=TINY_IMAGE_SIZE // 2,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=80,
            caption_projection_dim=32,
            pooled_projection_dim=40,
            out_channels=4,
            pos_embed_max_size=16,
        ),
    )


def _tiny_qwenimage():
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    tokenizer = qwen2_tokenizer()
    hidden = 32
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULERS["qwenimage"]),
        vae=AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 2],
            num_res_blocks=1,
            temperal_downsample=[False],
            latents_mean=[0.1, -0.2, 0.3, -0.4],
            latents_std=[1.5, 0.8, 2.0, 1.2],
        ),
        text_encoder=qwen_text_encoder(tokenizer, hidden),
        tokenizer=tokenizer,
        transformer=QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=hidden,
            axes_dims_rope=(4, 6, 6),
        ),
    )


_BUILDERS: dict[str, Callable[[], object]] = {
    "flux": _tiny_flux,
    "sd3": _tiny_sd3,
    "qwenimage": _tiny_qwenimage,
}


def build_tiny_pipeline(family: str, seed: int = 0):
    """A tiny random diffusers pipeline of ``family`` (float32), deterministic from ``seed``."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown tiny family {family!r}; choose from {TINY_FAMILIES}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipeline = _BUILDERS[family]()
    # Freshly constructed models are in training mode (T5 dropout on); loaded ones are not.
    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipeline


def save_tiny_pipeline(family: str, directory: str | Path, seed: int = 0) -> Path:
    """Build a tiny ``family`` pipeline and ``save_pretrained`` it to ``directory``."""
    target = Path(directory)
    build_tiny_pipeline(family, seed).save_pretrained(target)
    return target


TINY_BACKBONES: tuple[str, ...] = tuple(f"tiny-{family}" for family in TINY_FAMILIES)


def load_tiny_backbone(name: str, directory: str | Path, seed: int = 0, **spec: Any) -> Backbone:
    """Build the tiny pipeline ``name`` (``tiny-flux``, ...) into ``directory`` and load it.

    The spec defaults fit the tiny models (32 x 32 images, float32, 16 T5 tokens, full
    fine-tuning); keyword arguments override any :class:`BackboneConfig` field.
    """
    if name not in TINY_BACKBONES:
        raise ValueError(f"unknown tiny backbone {name!r}; choose from {TINY_BACKBONES}")
    family = name.removeprefix("tiny-")
    save_tiny_pipeline(family, directory, seed)
    options = {
        "height": TINY_IMAGE_SIZE,
        "width": TINY_IMAGE_SIZE,
        "dtype": "float32",
        "max_sequence_length": 16,
        "training": "full",
        **spec,
    }
    return load_backbone(BackboneConfig(family=family, path=str(directory), **options))
