"""The backbone adapter interface over diffusers pipelines, and everything the families share.

A :class:`Backbone` turns one diffusers-format checkpoint (Flux, SD3, QwenImage) into what the
JAGG core needs: ``velocity(z, sigma, cond) -> v`` with sigma in [0, 1], the checkpoint's own
sigma schedule, initial noise, batched prompt conditioning, decoding, FSDP units, LoRA or full
fine-tuning and activation checkpointing. The family modules only say what differs (text
encoders, the transformer call, latent layout); this module owns:

- the error messages naming the keys of :class:`BackboneConfig`, the config section of a backbone
  (defined, torch-free, in :mod:`jagg_pipeline.config.run`);
- resolving ``path`` to a local directory: an existing directory first, a hub id second (with
  ``HF_HUB_OFFLINE=1`` a missing model fails at once, naming the key to set);
- classifier-free guidance as ONE batched forward ordered [uncond; cond] (optionally rescaled
  per token to the conditional norm, as QwenImage does);
- latent geometry, 2x2 packing, noise, schedule, decoding with a KL VAE.

Latent layout: the sampler steps the layout the transformer consumes: packed
[B, (h/2)(w/2), 4C] tokens for Flux and QwenImage, [B, C, h, w] for SD3. ``sde.step`` is
elementwise, so the layout is invisible to the core; ``decode`` unpacks.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, get_args

import numpy as np
import torch
from torch import nn

from jagg_pipeline.backbones import lora
from jagg_pipeline.config import sources
from jagg_pipeline.config.run import BackboneConfig, BackboneDtype, TrainingMode
from jagg_pipeline.config.sources import snapshot_dir
from jagg_pipeline.support.errors import InputError
from jagg_pipeline.support.startup import importing

NEGATIVE = "negative_"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
# The projections of a joint (image + text stream) attention block, shared by all families.
JOINT_ATTENTION_TARGETS: tuple[str, ...] = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
TRAINING_MODES: tuple[str, ...] = get_args(TrainingMode)
if tuple(DTYPES) != get_args(BackboneDtype):
    raise ImportError(f"backbone DTYPES {tuple(DTYPES)} differ from config.BackboneDtype")

# Only the diffusers-format parts of a hub repository (Flux repos also hold a 23 GB
# original-format checkpoint at the top level).
HUB_PATTERNS = (
    "model_index.json",
    "scheduler/*",
    "transformer/*",
    "vae/*",
    "text_encoder*/*",
    "tokenizer*/*",
)


class BackboneLoadError(InputError):
    """A checkpoint could not be found or does not fit the configured family."""


# --------------------------------------------------------------------------------------------
# Finding the checkpoint
# --------------------------------------------------------------------------------------------


def resolve_checkpoint(spec: BackboneConfig) -> Path:
    """The local directory of ``spec.path``: an existing directory, else a hub id's snapshot.

    Hub snapshots are limited to the diffusers parts (:data:`HUB_PATTERNS`). Offline
    (``HF_HUB_OFFLINE=1``) a hub id must already be in the local cache.
    """
    return snapshot_dir(
        f"{spec.key}.path",
        spec.path,
        "a local diffusers-format directory (the one holding model_index.json) or a hub id",
        revision=spec.revision,
        allow_patterns=HUB_PATTERNS,
        error=BackboneLoadError,
    )


def read_model_index(directory: Path, spec: BackboneConfig) -> dict[str, Any]:
    """``model_index.json`` of a checkpoint, checked to be a checkpoint of ``spec.family``."""
    return sources.read_model_index(
        directory, f"{spec.key}.path", spec.path, spec.family, BackboneLoadError
    )


# --------------------------------------------------------------------------------------------
# Latent packing (Flux, QwenImage)
# --------------------------------------------------------------------------------------------


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: 2x2 patches as tokens, channels-major in a patch."""
    batch, channels, height, width = latents.shape
    patches = latents.view(batch, channels, height // 2, 2, width // 2, 2)
    return patches.permute(0, 2, 4, 1, 3, 5).reshape(
        batch, (height // 2) * (width // 2), channels * 4
    )


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents` for a latent of ``height`` x ``width``."""
    batch, _, packed_channels = tokens.shape
    patches = tokens.view(batch, height // 2, width // 2, packed_channels // 4, 2, 2)
    return patches.permute(0, 3, 1, 4, 2, 5).reshape(batch, packed_channels // 4, height, width)


def pad_tokens(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim 1 (the token axis) of ``tensor`` up to ``length``."""
    missing = length - tensor.shape[1]
    if missing <= 0:
        return tensor
    pad = tensor.new_zeros(tensor.shape[0], missing, *tensor.shape[2:])
    return torch.cat([tensor, pad], dim=1)


def padded_ids(tokenizer: Any, prompts: list[str], length: int) -> torch.Tensor:
    """Token ids padded and truncated to exactly ``length`` (how CLIP and T5 are fed)."""
    return tokenizer(
        prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
    ).input_ids


def t5_embeds(
    tokenizer: Any, encoder: nn.Module, prompts: list[str], length: int, device: torch.device
) -> torch.Tensor:
    """T5 hidden states of ``prompts`` padded to ``length``, run WITHOUT an attention mask.

    Flux and SD3 were trained this way: the padding tokens take part, so ``length``
    (``max_sequence_length``) changes the conditioning.
    """
    return encoder(padded_ids(tokenizer, prompts, length).to(device))[0]


def linspace_sigmas(num_steps: int) -> np.ndarray:
    """The base sigmas Flux and QwenImage pipelines hand to the scheduler: linspace(1, 1/N, N)."""
    return np.linspace(1.0, 1.0 / num_steps, num_steps)


# --------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------


class Backbone(ABC):
    """One DiT family behind the calling convention of the JAGG core.

    Subclasses set the class attributes and implement :meth:`_encode` (prompts -> positive
    conditioning), :meth:`predict` (one transformer forward) and, where they differ from the
    defaults here, the schedule, the latent geometry and decoding.
    """

    family: ClassVar[str]
    text_components: ClassVar[tuple[str, ...]]  # skipped when load_text_encoders is False
    cond_keys: ClassVar[tuple[str, ...]]  # positive conditioning; negatives get NEGATIVE + key
    packed: ClassVar[bool]  # whether latents are 2x2-packed tokens
    default_max_sequence_length: ClassVar[int]
    default_cfg_rescale: ClassVar[bool] = False
    default_lora_targets: ClassVar[tuple[str, ...]]

    def __init__(self, spec: BackboneConfig, components: dict[str, Any], path: Path) -> None:
        self.spec = spec
        self.path = path
        self.dtype = DTYPES[spec.dtype]
        self.device = torch.device(spec.device)
        self.transformer: nn.Module = components["transformer"]
        self.vae: nn.Module = components["vae"]
        self.scheduler = components["scheduler"]
        self.text: dict[str, Any] = {
            name: components[name]
            for name in self.text_components
            if components.get(name) is not None
        }
        self.cfg_scale = float(spec.cfg_scale)
        self.cfg_rescale = (
            self.default_cfg_rescale if spec.cfg_rescale is None else bool(spec.cfg_rescale)
        )
        self.max_sequence_length = spec.max_sequence_length or self.default_max_sequence_length
        self.guidance_scale = self._guidance_value(spec)
        self.latent_height, self.latent_width = self._latent_size()

        # Eval mode everywhere (the DiTs have no dropout, T5 has): rollout and training must
        # compute the same function for the ratio to be exactly 1.
        for module in (self.transformer, self.vae, *self._text_modules()):
            module.to(self.device).eval()
        for module in (self.vae, *self._text_modules()):
            module.requires_grad_(False)
        self.set_training_mode(spec.training, spec.lora)
        self.set_gradient_checkpointing(spec.gradient_checkpointing)

    @classmethod
    def load(cls, spec: BackboneConfig) -> Backbone:
        """Load the checkpoint ``spec.path`` (local directory first, hub id second).

        The directory is checked first (model_index.json, pipeline class, component folders)
        so that mistakes fail with a message naming the config key; the components are then
        read by the family's own diffusers pipeline loader and the pipeline object dropped.
        """
        if spec.family != cls.family:
            raise ValueError(f"{cls.__name__} loads family {cls.family!r}, got {spec.family!r}")
        path = resolve_checkpoint(spec)
        index = read_model_index(path, spec)
        # Most of a stage's start-up: the pipeline module imports diffusers' models and loaders,
        # transformers, peft and scipy.
        with importing():
            import diffusers

            # diffusers only loads components from libraries already imported; components of
            # our own package (the toy world's codec) are code we ship, so import them first.
            for entry in index.values():
                if isinstance(entry, list) and str(entry[0]).startswith("jagg_pipeline."):
                    importlib.import_module(entry[0])
            pipeline_class = getattr(diffusers, sources.PIPELINE_CLASSES[cls.family])
        skipped = {} if spec.load_text_encoders else dict.fromkeys(cls.text_components)
        pipeline = pipeline_class.from_pretrained(path, dtype=DTYPES[spec.dtype], **skipped)
        return cls(spec, dict(pipeline.components), path)

    # ---------------------------------------------------------------------------- conditioning

    @abstractmethod
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Positive conditioning of ``prompts``: the tensors of :attr:`cond_keys`, batched."""

    def _pair(
        self, cond: dict[str, torch.Tensor], negative: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Make conditional and unconditional tensors stackable (QwenImage pads lengths)."""
        return cond, negative

    def encode_prompts(
        self, prompts: Sequence[str], *, grad: bool = False
    ) -> dict[str, torch.Tensor]:
        """Batched conditioning of ``prompts`` (plus the negative prompt's when CFG is on).

        A dict of tensors batched along dim 0, on the backbone's device and dtype: it can be
        cached (e.g. safetensors) and fed to :meth:`velocity` without the text encoders.
        ``grad=True`` keeps the graph through the text encoders (the toy world trains them
        jointly with the transformer); GRPO never does.
        """
        with torch.set_grad_enabled(grad):
            return self._encode_with_negative(list(prompts))

    def _encode_with_negative(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        if not self.text:
            raise RuntimeError(
                f"text encoders were not loaded ({self.spec.key}.load_text_encoders is false): "
                "load precomputed conditioning instead of encoding prompts"
            )
        cond = self._encode(prompts)
        if self.cfg_scale > 1.0:
            single = self._encode([self.spec.negative_prompt])
            negative = {k: v.expand(len(prompts), *v.shape[1:]) for k, v in single.items()}
            cond, negative = self._pair(cond, negative)
            cond = {**cond, **{NEGATIVE + k: v.contiguous() for k, v in negative.items()}}
        return cond

    # ---------------------------------------------------------------------------- velocity

    @abstractmethod
    def predict(
        self, z: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One transformer forward: the velocity at latent ``z``, sigma [B] in [0, 1]."""

    def velocity(
        self, z: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """v = eps - x0 at ``z``; with CFG one batched forward over [uncond; cond]."""
        if self.cfg_scale <= 1.0:
            return self.predict(z, sigma, cond)
        missing = [NEGATIVE + k for k in self.cond_keys if NEGATIVE + k not in cond]
        if missing:
            raise KeyError(
                f"conditioning lacks {missing}: it was encoded without CFG; re-encode it with "
                f"{self.spec.key}.cfg_scale > 1"
            )
        both = {k: torch.cat([cond[NEGATIVE + k], cond[k]]) for k in self.cond_keys}
        uncond, text = self.predict(torch.cat([z, z]), torch.cat([sigma, sigma]), both).chunk(2)
        guided = uncond + self.cfg_scale * (text - uncond)
        if self.cfg_rescale:
            # Per token (last dim of the packed layout): keep the conditional prediction's norm.
            guided = guided * (
                torch.norm(text, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True)
            )
        return guided

    def __call__(
        self, z: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return self.velocity(z, sigma, cond)

    def _unit_timestep(self, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Timestep in [0, 1] as Flux/QwenImage pipelines compute it: (1000 sigma in dtype) / 1000.

        The pipelines round the scheduler's 1000-scaled timestep to the latent dtype before
        dividing; doing the same keeps low-precision runs on the pipeline's numbers.
        """
        scale = float(self.scheduler.config.num_train_timesteps)
        return (sigma * scale).to(dtype) / scale

    def _guidance_value(self, spec: BackboneConfig) -> float | None:
        """The guidance-embedding value, or None if the transformer has no guidance embedding."""
        if self.transformer.config.get("guidance_embeds", False):
            return 3.5 if spec.guidance_scale is None else float(spec.guidance_scale)
        if spec.guidance_scale is not None:
            raise ValueError(
                f"{spec.key}.guidance_scale is set but this {self.family} transformer has no "
                f"guidance embedding; for classifier-free guidance set {spec.key}.cfg_scale"
            )
        return None

    # ---------------------------------------------------------------------------- latents

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell (a KL VAE halves the size at every block but the last)."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        channels = self.transformer.config.in_channels
        return channels // 4 if self.packed else channels

    def _latent_size(self) -> tuple[int, int]:
        """(h, w) of the unpacked latent; checks the image size fits the VAE and patching."""
        multiple = self.vae_scale_factor * 2
        if self.spec.height % multiple or self.spec.width % multiple:
            raise ValueError(
                f"{self.spec.key}.height/width ({self.spec.height}x{self.spec.width}) must be "
                f"multiples of {multiple} for this {self.family} checkpoint"
            )
        return self.spec.height // self.vae_scale_factor, self.spec.width // self.vae_scale_factor

    @property
    def image_seq_len(self) -> int:
        """Image tokens the transformer sees (2x2 patches): what dynamic shifting scales with."""
        return (self.latent_height // 2) * (self.latent_width // 2)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample shape of the latent the sampler steps (packed tokens or C x h x w)."""
        if self.packed:
            return (self.image_seq_len, self.latent_channels * 4)
        return (self.latent_channels, self.latent_height, self.latent_width)

    def initial_noise(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """x at sigma = 1, drawn exactly as the family's pipeline draws it (then packed)."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (batch, self.latent_channels, self.latent_height, self.latent_width)
        noise = randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)
        return pack_latents(noise) if self.packed else noise

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [0, 1] from final latents in the sampler's layout."""
        if self.packed:
            latents = unpack_latents(latents, self.latent_height, self.latent_width)
        pixels = self._decode_latents(latents.to(self.device, self.vae.dtype))
        return (pixels / 2 + 0.5).clamp(0, 1)

    def _decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """KL VAE (Flux, SD3): undo the scaling and shift, decode to [-1, 1]."""
        config = self.vae.config
        shift = config.shift_factor or 0.0
        return self.vae.decode(latents / config.scaling_factor + shift, return_dict=False)[0]

    # ---------------------------------------------------------------------------- schedule

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``num_steps + 1`` sigmas (float32, ending at 0) from the checkpoint's scheduler.

        Calls the scheduler's own ``set_timesteps`` with the arguments the family's pipeline
        passes (re-deriving the schedule gets SD3's and QwenImage's wrong).
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.scheduler.set_timesteps(num_steps, **self._schedule_kwargs(num_steps))
        return self.scheduler.sigmas.detach().to("cpu", torch.float32).clone()

    def _schedule_kwargs(self, num_steps: int) -> dict[str, Any]:
        """Extra ``set_timesteps`` arguments: ``mu`` when the scheduler shifts dynamically."""
        if not self.scheduler.config.get("use_dynamic_shifting", False):
            return {}
        return {"mu": self._mu()}

    def _mu(self) -> float:
        """Dynamic-shift mu from the image token count, as the pipelines compute it."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config
        return calculate_shift(
            self.image_seq_len,
            config.base_image_seq_len,
            config.max_image_seq_len,
            config.base_shift,
            config.max_shift,
        )

    # ---------------------------------------------------------------------------- training

    def dead_modules(self) -> list[str]:
        """Transformer submodules whose parameters cannot reach the output (frozen, no LoRA)."""
        return []

    def set_training_mode(
        self, mode: TrainingMode, settings: lora.LoraConfig | None = None
    ) -> None:
        """``full``: every live transformer parameter trains; ``lora``: adapters only.

        Parameters under :meth:`dead_modules` never train: they get no gradient, which
        distributed wrappers would report as unused parameters.
        """
        if mode == "full":
            if lora.has_lora(self.transformer):
                raise ValueError("this backbone carries LoRA adapters; load a fresh one for full")
            self.transformer.requires_grad_(True)
            for name in self.dead_modules():
                self.transformer.get_submodule(name).requires_grad_(False)
        elif mode == "lora":
            if not lora.has_lora(self.transformer):
                settings = settings or lora.LoraConfig()
                targets = lora.target_modules(
                    self.transformer,
                    settings.targets or self.default_lora_targets,
                    exclude=self.dead_modules(),
                )
                lora.add_lora(self.transformer, settings, targets)
        else:
            raise ValueError(f"training mode must be one of {TRAINING_MODES}, got {mode!r}")
        self.training_mode = mode
        self._eval_adapters()

    def _eval_adapters(self) -> None:
        """Eval mode again: peft creates its adapter modules (dropout too) in training mode."""
        self.transformer.eval()

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters an optimiser should update."""
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def save_lora(self, directory: str | Path) -> Path:
        """Save the LoRA adapters alone (config + safetensors) into ``directory``."""
        return lora.save_lora(self.transformer, directory)

    def load_lora(self, directory: str | Path) -> None:
        """Load adapters saved by :meth:`save_lora` (into this backbone's adapters, if any)."""
        lora.load_lora(self.transformer, directory)
        self.training_mode = "lora"
        self._eval_adapters()

    def compute_in_bf16(self) -> None:
        """Compute as FSDP2's bf16 ``MixedPrecisionPolicy`` does, without sharding.

        For the stages that only run the model (rollout, evaluation) under
        ``mixed_precision: bf16``: FSDP2 casts every parameter of each unit to bfloat16 for
        compute (buffers stay as they are) and the floating inputs of each unit's forward, and
        leaves the output in bfloat16. Doing the same here gives the velocities that training
        recomputes, so the on-policy ratio is 1. Irreversible: the float32 weights are gone.
        """
        from torch.utils._pytree import tree_map_only

        def cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return tree_map_only(
                torch.Tensor,
                lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t,
                (args, kwargs),
            )

        for param in self.transformer.parameters():
            param.data = param.data.to(torch.bfloat16)
        for unit in {*self.fsdp_units(), self.transformer}:
            unit.register_forward_pre_hook(cast_inputs, with_kwargs=True)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each transformer block's activations in backward (memory for compute)."""
        if enabled:
            self.transformer.enable_gradient_checkpointing()
        else:
            self.transformer.disable_gradient_checkpointing()

    def fsdp_units(self) -> list[nn.Module]:
        """The transformer blocks to shard one by one (the model's ``_no_split_modules``)."""
        names = set(self.transformer._no_split_modules or ())
        return [m for m in self.transformer.modules() if type(m).__name__ in names]

    def _text_modules(self) -> list[nn.Module]:
        return [m for m in self.text.values() if isinstance(m, nn.Module)]
