"""A run's configuration: one typed dataclass per section, loaded strictly from YAML.

Sections: ``backbone`` (:class:`BackboneConfig`, with its :class:`LoraConfig`), ``sampler``,
``advantage`` (read by the score stage only), ``grpo`` (the train stage's loss), ``jagg``,
``rewards`` (:class:`RewardsConfig`, one field per registered reward), ``train``, ``eval``,
``tracking``. The JSON Schema that Snakemake validates config.yaml against is derived from
these classes (``python -m jagg_pipeline config schema``), so the two cannot drift apart.
Defaults describe the embedded toy world.

Torch-free on purpose: every Snakemake job parses the config at start-up. The backbone and
reward modules that use these types (and map the dtype names to torch dtypes) import them from
here; :mod:`jagg_pipeline.rewards.registry` checks at import that its rewards are exactly
:data:`REWARD_NAMES` with these spec classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from jagg_pipeline.config.fields import ConfigError, check_bounds, digest, field, from_dict
from jagg_pipeline.config.schema import json_schema
from jagg_pipeline.config.yaml_io import load_yaml as _load_yaml
from jagg_pipeline.core.options import (
    Anchors,
    EndpointBackward,
    EngineOptions,
    GradMode,
    NoInterpVariant,
    Weights,
    option_field,
)

# The names of jagg_pipeline.backbones.loading.DTYPES / jagg_pipeline.rewards.base.DTYPES (each
# module checks at import that they agree).
BackboneDtype = Literal["float32", "bfloat16", "float16", "float64"]
BackboneFamily = Literal["flux", "sd3", "qwenimage"]
TrainingMode = Literal["lora", "full"]
RewardDtype = Literal["float32", "bfloat16", "float16"]

# --------------------------------------------------------------------------------------------
# backbone
# --------------------------------------------------------------------------------------------


# Pixels per latent token side in every family: 8x VAE downsampling, 2 x 2 patches (the toy
# world: 2x codec, 2 x 2 patches, then 32-pixel images).
PIXELS_PER_TOKEN = 16


@dataclass(frozen=True)
class LoraConfig:
    """Rank, scale and placement of the LoRA adapters."""

    rank: int = field(16, help="adapter rank r", minimum=1)
    alpha: float | None = field(
        None, help="adapter scale numerator: the update is scaled by alpha / rank (null: rank)"
    )
    dropout: float = field(
        0.0,
        help="dropout on the adapters' input; only 0: dropout makes the training forward a "
        "random function, so the PPO ratio of the on-policy step is no longer 1",
        minimum=0,
    )
    targets: tuple[str, ...] | None = field(
        None,
        help="module-name suffixes that receive adapters, such as attn.to_q (null: the "
        "family's default list)",
    )
    seed: int = field(0, help="seed of the adapters' initialisation (A random, B zero)", minimum=0)

    def __post_init__(self) -> None:
        if self.dropout != 0:
            # peft's dropout acts in training mode only, and rollout, evaluation and training
            # all run the transformer in eval mode, where it would silently do nothing.
            raise ValueError(
                f"backbone.lora.dropout: {self.dropout} is not supported, set 0: GRPO's ratio "
                "compares the training forward with the rollout's, so dropout in training makes "
                "the on-policy ratio random (it clips steps that are exactly on-policy) and "
                "breaks velocity reuse, and dropout in rollout makes samples random"
            )
        check_bounds(self, "lora")


@dataclass(frozen=True)
class BackboneConfig:
    """The ``backbone`` section: which checkpoint, and how to drive it.

    The defaults are the default experiment's: the toy world's SD3 (32 px, float32, full
    fine-tuning); a real checkpoint's config sets its own (see presets/).
    """

    family: BackboneFamily = field("sd3", help="model family, which picks the adapter")
    path: str = field(
        "results/toyworld/sd3",
        help="a local diffusers-format directory (the one holding model_index.json) or, if no "
        "such directory exists, a hub id",
    )
    revision: str | None = field(None, help="hub revision (branch, tag or commit) of a hub id")
    height: int = field(32, help="image height in pixels (a multiple of 16)", minimum=1)
    width: int = field(32, help="image width in pixels (a multiple of 16)", minimum=1)
    dtype: BackboneDtype = field(
        "float32", help="precision the pipeline is loaded in (and trained weights are kept in)"
    )
    mixed_precision: Literal["no", "bf16"] = field(
        "no",
        help="'bf16': the transformer computes in bfloat16 over weights kept in dtype (FSDP2's "
        "MixedPrecisionPolicy in training, gradients reduced in float32); rollout and "
        "evaluation compute the same way, so the on-policy ratio is 1",
    )
    device: str = field("cpu", help="torch device the pipeline is loaded onto")
    cfg_scale: float = field(
        1.0,
        help="> 1 turns on true classifier-free guidance against negative_prompt (SD3's "
        "guidance_scale, Flux/QwenImage's true_cfg_scale); 1: off",
        minimum=1,
    )
    negative_prompt: str = field("", help="the negative prompt of classifier-free guidance")
    cfg_rescale: bool | None = field(
        None,
        help="rescale the guided velocity per token to the conditional norm (null: the family "
        "default, on for QwenImage)",
    )
    guidance_scale: float | None = field(
        None,
        help="the guidance embedding of a guidance-distilled model (Flux-dev; null: 3.5 as "
        "FluxPipeline)",
    )
    max_sequence_length: int | None = field(
        16, help="cap on the T5/Qwen prompt tokens (null: the family default)", minimum=1
    )
    training: TrainingMode = field(
        "full", help="'lora': train the adapters only; 'full': every transformer weight"
    )
    lora: LoraConfig = field(default_factory=LoraConfig, help="the adapters of training 'lora'")
    gradient_checkpointing: bool = field(
        False, help="activation checkpointing of the transformer (less memory, more compute)"
    )
    load_text_encoders: bool = field(
        True, help="false skips the text encoders (conditioning precomputed)"
    )
    key: str = field(
        "backbone", help="the config path that error messages name (set by code)", internal=True
    )

    def __post_init__(self) -> None:
        if self.dtype not in get_args(BackboneDtype):
            raise ValueError(
                f"{self.key}.dtype must be one of {get_args(BackboneDtype)}, got {self.dtype!r}"
            )
        if self.training not in get_args(TrainingMode):
            raise ValueError(
                f"{self.key}.training must be one of {get_args(TrainingMode)}, "
                f"got {self.training!r}"
            )
        check_bounds(self, self.key)
        if self.mixed_precision == "bf16" and self.dtype == "float16":
            raise ValueError(
                f"{self.key}.mixed_precision: 'bf16' over {self.key}.dtype 'float16' computes "
                "in fewer mantissa bits than the weights hold; set dtype to float32 (mixed "
                "precision) or mixed_precision to 'no'"
            )
        for side in ("height", "width"):
            if getattr(self, side) % PIXELS_PER_TOKEN:
                raise ValueError(
                    f"{self.key}.{side}: {getattr(self, side)} is not a multiple of "
                    f"{PIXELS_PER_TOKEN} (VAE downsampling x 2 x 2 patches: one latent token)"
                )


# --------------------------------------------------------------------------------------------
# rewards (one spec per module of jagg_pipeline.rewards)
# --------------------------------------------------------------------------------------------

_BATCH_HELP = "images per forward of the model"


@dataclass
class HPSv21Config:
    """``rewards.hpsv21``: the checkpoint and the open_clip architecture it belongs to."""

    checkpoint: str = field(
        "xswu/HPSv2/HPS_v2.1_compressed.pt",
        help="a local HPS_v2.1_compressed.pt or a hub owner/name/file",
    )
    arch: str = field(
        "ViT-H-14",
        help="an open_clip model name, or the path of an open_clip model-config JSON (whose "
        "file stem becomes the name); only tests and experiments change it",
    )
    dtype: RewardDtype = field("float32", help="precision the model runs in")
    batch_size: int = field(32, help=_BATCH_HELP, minimum=1)


@dataclass
class PickScoreConfig:
    """``rewards.pickscore``: where the model and its processor live, and how to run it."""

    model: str = field(
        "yuvalkirstain/PickScore_v1",
        help="the PickScore CLIPModel: a local save_pretrained directory or a hub id",
    )
    processor: str = field(
        "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        help="its CLIP processor: a local save_pretrained directory or a hub id",
    )
    dtype: RewardDtype = field("float32", help="precision the model runs in")
    batch_size: int = field(32, help=_BATCH_HELP, minimum=1)


@dataclass
class ClipScoreConfig:
    """``rewards.clipscore``: where the model (and optionally its processor) live."""

    model: str = field(
        "openai/clip-vit-large-patch14",
        help="the CLIPModel: a local save_pretrained directory or a hub id",
    )
    processor: str | None = field(
        None, help="its processor, a directory or hub id (null: the model's own)"
    )
    dtype: RewardDtype = field("float32", help="precision the model runs in")
    batch_size: int = field(32, help=_BATCH_HELP, minimum=1)


@dataclass
class JpegCompressibilityConfig:
    """``rewards.jpeg_compressibility``: the JPEG quality."""

    quality: int = field(
        95,
        help="JPEG quality of the encoding (DDPO uses 95; Pillow's useful range is 1-95)",
        minimum=1,
        maximum=95,
    )


@dataclass
class ToyAttributesConfig:
    """``rewards.toy_attributes``: how many images to score at once."""

    batch_size: int = field(256, help="images scored at once", minimum=1)


@dataclass
class ToyClipScoreConfig:
    """``rewards.toy_clipscore``: the toy CLIP directory (model and processor)."""

    model: str = field(
        "results/toyworld/clip",
        help="the toy CLIP directory (model and processor) that toyworld build saves",
    )
    dtype: RewardDtype = field("float32", help="precision the model runs in")
    batch_size: int = field(256, help=_BATCH_HELP, minimum=1)


@dataclass
class RewardsConfig:
    """The ``rewards:`` section: weights of the rewards that run, each model's settings.

    One field per registered reward, named by its ``NAME``, described by its summary.
    """

    weights: dict[str, float] = field(
        default_factory=dict, help="which rewards run and their weights: {name: weight}"
    )
    normalize_separately: bool = field(
        False, help="group-normalise each reward's advantage before weighting"
    )
    device: str | None = field(
        None, help="torch device of the reward models (null: backbone.device)"
    )
    hpsv21: HPSv21Config = field(
        default_factory=HPSv21Config,
        help="HPSv2.1: open_clip ViT-H-14 + HPS v2.1 weights; cosine, no logit scale, in [-1, 1].",
    )
    pickscore: PickScoreConfig = field(
        default_factory=PickScoreConfig,
        help="PickScore: CLIP-H tuned on Pick-a-Pic; exp(logit_scale) * cosine (typically 18-24).",
    )
    clipscore: ClipScoreConfig = field(
        default_factory=ClipScoreConfig,
        help="CLIPScore: CLIP ViT-L/14, torchmetrics convention max(100 cos, 0), in [0, 100].",
    )
    jpeg_compressibility: JpegCompressibilityConfig = field(
        default_factory=JpegCompressibilityConfig,
        help="JPEG compressibility (DDPO): minus the JPEG size in kB, in (-inf, 0]; prompt "
        "ignored.",
    )
    toy_attributes: ToyAttributesConfig = field(
        default_factory=ToyAttributesConfig,
        help="Toy attributes: whether an image shows its toy caption's shape, colour, "
        "position, background.",
    )
    toy_clipscore: ToyClipScoreConfig = field(
        default_factory=ToyClipScoreConfig,
        help="Toy CLIPScore: CLIPScore (max(100 cos, 0), in [0, 100]) under the toy world's CLIP.",
    )

    def __post_init__(self) -> None:
        for name, weight in self.weights.items():
            if name not in REWARD_NAMES:
                raise ValueError(
                    f"rewards.weights.{name}: unknown reward; known rewards: "
                    f"{', '.join(sorted(REWARD_NAMES))}"
                )
            if not math.isfinite(weight):  # NaN or inf advantages, silently
                raise ValueError(f"rewards.weights.{name}: must be a finite number, got {weight}")

    def resolve_device(self, backbone_device: str) -> str:
        """The device the reward models run on: ``device``, else the backbone's."""
        return self.device or backbone_device

    def spec(self, name: str) -> Any:
        """The settings of reward ``name``."""
        if name not in REWARD_NAMES:
            raise ConfigError(
                f"rewards.{name}: unknown reward; known rewards: {', '.join(sorted(REWARD_NAMES))}"
            )
        return getattr(self, name)


# The registered rewards, in registry order: every field of RewardsConfig but its options.
REWARD_NAMES: tuple[str, ...] = tuple(
    f.name
    for f in fields(RewardsConfig)
    if f.name not in ("weights", "normalize_separately", "device")
)

# --------------------------------------------------------------------------------------------
# the other sections
# --------------------------------------------------------------------------------------------


@dataclass
class SamplerConfig:
    """How rollouts are sampled: schedule, SDE family, group size, which steps are trained."""

    # The SDE segment was called a window, a word that belongs to JAGG's W.
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "window_size": "sampler.segment_steps",
        "window_start": "sampler.segment_start",
    }
    MOVED_VALUES: ClassVar[dict[str, dict[Any, Any]]] = {"trajectory": {"window": "segment"}}

    prompts: str = field(
        "toy:train",
        help="training prompt pool: a prompt file (.txt, .json, .jsonl, .csv, .parquet) or "
        "'toy:train' / 'toy:heldout'",
    )
    prompt_column: str | None = field(None, help="prompt column of a tabular prompt file")
    num_steps: int = field(10, help="denoising steps of a rollout", minimum=1)
    step: Literal["flow_grpo", "dance_grpo", "cps"] = field(
        "flow_grpo",
        help="SDE step family: flow_grpo (Flow-GRPO), dance_grpo (DanceGRPO) or cps "
        "(coefficients-preserving sampling)",
    )
    noise_level: float = field(
        0.7,
        help="a of Flow-GRPO (0.7 SD3.5, 0.9 Flux, 1.2 QwenImage), eta of DanceGRPO, a of CPS",
        minimum=0,
    )
    group_size: int = field(
        8, help="samples per prompt (G of GRPO; >= 2: GRPO compares samples in a group)", minimum=2
    )
    prompts_per_round: int = field(8, help="prompts sampled per training round", minimum=1)
    batch_size: int = field(16, help="samples per network forward during rollout", minimum=1)
    trajectory: Literal["full", "segment"] = field(
        "segment",
        help="'full': SDE on every step, train a selection; 'segment': SDE on a segment of "
        "consecutive steps, ODE elsewhere (Flow-GRPO-Fast / MixGRPO)",
    )
    trained_fraction: float = field(
        1.0,
        help="'full' only: fraction of steps trained (the last step never is)",
        exclusive_minimum=0,
        maximum=1,
    )
    store_velocities: bool = field(
        True,
        help="store the velocities the first optimizer step of a round can reuse to skip JAGG's "
        "interior forwards (one latent per sample at each step of the approximated windows "
        "with interiors, in the compute dtype; none under mode exact, W = 2, jagg_frac 0, "
        "no_interp drop or jagg.reuse_velocities false)",
    )
    segment_steps: int = field(8, help="'segment' only: consecutive SDE steps", minimum=1)
    segment_start: list[int] = field(
        default_factory=lambda: [0, 0],
        help="'segment' only: inclusive [lo, hi] range of the segment's random first step",
    )

    def __post_init__(self) -> None:
        if len(self.segment_start) != 2 or not 0 <= self.segment_start[0] <= self.segment_start[1]:
            raise ValueError(f"sampler.segment_start must be [lo, hi], got {self.segment_start}")
        if self.batch_size % self.group_size:
            raise ValueError(
                f"sampler.batch_size: {self.batch_size} is not a multiple of sampler.group_size "
                f"{self.group_size} (a rollout micro-batch holds whole prompt groups)"
            )
        if (
            self.trajectory == "segment"
            and self.segment_start[1] + self.segment_steps > self.num_steps
        ):
            raise ValueError(
                f"sampler.segment_start {self.segment_start} + segment_steps {self.segment_steps} "
                f"exceeds num_steps {self.num_steps}"
            )


@dataclass
class AdvantageConfig:
    """How the score stage turns rewards into GRPO advantages (train reads them from its table)."""

    std_mode: Literal["group", "global"] = field(
        "group", help="normalise advantages by each group's std or the batch's"
    )
    eps: float = field(
        1e-4,
        help="added to the std before dividing (> 0: a group of equal rewards has std 0)",
        exclusive_minimum=0,
    )
    clip: float = field(5.0, help="advantages are clipped to +-clip", exclusive_minimum=0)


@dataclass
class GRPOConfig:
    """The clipped policy objective of the train stage."""

    clip_range: float = field(
        1e-4,
        help="PPO ratio clip e (1e-4 full trajectories, 1e-5 segments)",
        exclusive_minimum=0,
    )
    kl_beta: float = field(
        0.0, help="weight of the KL to the frozen reference policy (0: off)", minimum=0
    )


@dataclass
class JaggConfig:
    """Which gradient engine trains the windows of trained steps, and how they are routed."""

    mode: GradMode = field("jagg", help="exact baseline, JAGG, or the no-interpolation ablation")
    window: int = field(4, help="W: trained steps per window (>= 2)", minimum=2)
    anchors: Anchors = option_field("anchors")
    jagg_frac: float | Literal["auto"] = field(
        1.0,
        help="fraction of windows (from high noise) routed to the approximation, or 'auto' "
        "(route windows whose probed cos-sim clears auto_threshold)",
        minimum=0,
        maximum=1,
    )
    weights: Weights = option_field("weights")
    no_interp: NoInterpVariant = option_field("no_interp")
    stack_forwards: bool = option_field("stack_forwards")
    auto_threshold: float = field(
        0.8, help="'auto': minimum cos-sim to route a window to jagg", minimum=-1, maximum=1
    )
    auto_every: int = field(10, help="'auto': re-probe every K rounds", minimum=1)
    auto_probe_groups: int = field(
        2, help="prompt groups in the probe batch (of 'auto' and of probe_every)", minimum=1
    )
    reuse_velocities: bool = field(
        True,
        help="on a round's on-policy optimizer step (weights still those that sampled the "
        "rollout), take interior velocities from the rollout instead of recomputing them; "
        "checked by value: a window whose recomputed endpoints differ from the stored ones "
        "beyond the compute precision's rounding recomputes its interiors",
    )
    endpoint_backward: EndpointBackward = option_field("endpoint_backward")
    probe_every: int = field(
        0,
        help="also probe every window's cos-sim with the exact gradient every K rounds, for the "
        "report's heatmap (0: only when 'auto' routing probes)",
        minimum=0,
    )

    def engine_options(self) -> EngineOptions:
        """The options every gradient-engine call of a run takes (training and probes)."""
        return EngineOptions(**{name: getattr(self, name) for name in EngineOptions.names()})


def lr_factor(step: int, *, total: int, warmup: int, kind: str) -> float:
    """Multiplier of ``train.lr`` at optimizer step ``step`` (linear warm-up, then decay)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.lr_schedule must be constant, linear or cosine, got {kind!r}")


@dataclass
class TrainConfig:
    """The optimiser and the round loop."""

    # Rollout and evaluation honour it too, so it belongs to the backbone's section now.
    MOVED_KEYS: ClassVar[dict[str, str]] = {"mixed_precision": "backbone.mixed_precision"}

    rounds: int = field(30, help="training rounds (rollout -> score -> update)", minimum=1)
    lr: float = field(
        1e-4, help="AdamW learning rate (the toy world falls at 3e-4)", exclusive_minimum=0
    )
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], help="AdamW betas")
    weight_decay: float = field(0.0, help="AdamW weight decay", minimum=0)
    grad_clip: float = field(1.0, help="max global grad norm (0: off)", minimum=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = field(
        "constant", help="decay of the lr over all optimizer steps"
    )
    warmup_steps: int = field(0, help="linear warm-up steps", minimum=0)
    minibatches: int = field(
        1, help="optimizer steps per round (the round's groups are split)", minimum=1
    )
    ema_decay: float | None = field(
        None,
        help="decay of an EMA of the trained weights used for evaluation (null: none)",
        minimum=0,
        maximum=1,
    )
    nodes: int = field(
        1,
        help="nodes per training job: one torchrun agent per node under srun, joined by a c10d "
        "rendezvous on the first (> 1 needs a cluster: --profile workflow/profiles/slurm)",
        minimum=1,
    )
    nproc: int = field(
        1, help="processes (GPUs) per node of a training job, under torchrun", minimum=1
    )
    allow_skipped_round: bool = field(
        False,
        help="write the checkpoint even when every optimizer step of a round was skipped "
        "(non-finite loss or gradient); false: the round fails",
    )
    seed: int = field(0, help="seed of prompts, noise and everything else random", minimum=0)

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"train.betas: expected two numbers in [0, 1), got {self.betas}")

    @property
    def world_size(self) -> int:
        """Training processes in all: ``nodes`` x ``nproc``."""
        return self.nodes * self.nproc

    def round_lrs(self, round_index: int) -> list[float]:
        """The learning rate of each optimizer step of round ``round_index`` (:func:`lr_factor`).

        What a round's training reads of the schedule: under a constant one the same whatever
        ``rounds`` is, so a run extended by more rounds keeps the rounds it trained.
        """
        steps = range(round_index * self.minibatches, (round_index + 1) * self.minibatches)
        total = self.rounds * self.minibatches
        return [
            self.lr * lr_factor(step, total=total, warmup=self.warmup_steps, kind=self.lr_schedule)
            for step in steps
        ]


@dataclass
class EvalConfig:
    """Deterministic evaluation of a checkpoint."""

    num_steps: int = field(20, help="ODE steps at evaluation", minimum=1)
    prompts: str = field(
        "toy:heldout", help="a prompt file, or 'toy:heldout' / 'toy:train' for the toy world"
    )
    column: str | None = field(None, help="column of a tabular prompt file")
    max_prompts: int = field(39, help="evaluate at most this many prompts", minimum=1)
    samples_per_prompt: int = field(2, help="images per prompt", minimum=1)
    seed: int = field(
        1234, help="seed of the evaluation noise (fixed across checkpoints)", minimum=0
    )
    metrics: list[str] = field(
        default_factory=lambda: ["toy_attributes", "toy_clipscore"],
        help="reward names reported as metrics (their settings come from the rewards section)",
    )
    every: int = field(10, help="evaluate every K rounds (and the last)", minimum=1)

    def __post_init__(self) -> None:
        for name in self.metrics:
            if name not in REWARD_NAMES:
                raise ValueError(
                    f"eval.metrics: {name!r} is an unknown reward; known rewards: "
                    f"{', '.join(REWARD_NAMES)}"
                )


@dataclass
class TrackingConfig:
    """Where metrics go."""

    backend: Literal["mlflow", "none"] = field("mlflow", help="mlflow or none")
    uri: str = field("sqlite:///results/mlflow.db", help="MLflow tracking URI")
    mlflow_experiment: str = field("jagg-toy", help="MLflow experiment name")

    # The MLflow experiment was called experiment, the word for a workflow target.
    MOVED_KEYS: ClassVar[dict[str, str]] = {"experiment": "tracking.mlflow_experiment"}

    def __post_init__(self) -> None:
        if not self.mlflow_experiment.strip():
            raise ValueError("tracking.mlflow_experiment: must not be empty")


@dataclass
class RunConfig:
    """A run's config: every section, defaults filled."""

    backbone: BackboneConfig = field(
        default_factory=BackboneConfig,
        help="the DiT checkpoint and how to drive it",
    )
    sampler: SamplerConfig = field(default_factory=SamplerConfig, help="rollout sampling")
    advantage: AdvantageConfig = field(
        default_factory=AdvantageConfig, help="group advantages (score stage)"
    )
    grpo: GRPOConfig = field(default_factory=GRPOConfig, help="policy loss (train stage)")
    jagg: JaggConfig = field(default_factory=JaggConfig, help="gradient engine and routing")
    rewards: RewardsConfig = field(
        default_factory=lambda: RewardsConfig(weights={"toy_attributes": 1.0}),
        help="training rewards and every reward model's settings",
    )
    train: TrainConfig = field(default_factory=TrainConfig, help="optimiser and rounds")
    eval: EvalConfig = field(default_factory=EvalConfig, help="evaluation")
    tracking: TrackingConfig = field(default_factory=TrackingConfig, help="metrics tracking")

    def __post_init__(self) -> None:
        if not self.rewards.weights:
            raise ValueError("rewards.weights: name at least one reward to train on")
        trained = self.trained_steps_at_most()
        if self.jagg.mode != "exact" and self.jagg.window > trained:
            raise ValueError(
                f"jagg.window: {self.jagg.window} is more than the {trained} trained steps of a "
                "rollout (sampler.segment_steps, or trained_fraction of num_steps - 1 for 'full')"
            )
        sampler, train = self.sampler, self.train
        groups_per_batch = sampler.batch_size // sampler.group_size
        micro_batches = -(-sampler.prompts_per_round // groups_per_batch)
        if micro_batches % train.minibatches:
            raise ValueError(
                f"train.minibatches: {train.minibatches} does not divide the rollout's "
                f"{micro_batches} micro-batch(es) (sampler.prompts_per_round "
                f"{sampler.prompts_per_round} groups, {groups_per_batch} per sampler.batch_size)"
            )
        if (micro_batches // train.minibatches) % train.world_size:
            key = "train.nproc" if train.nodes == 1 else "train.nodes"
            raise ValueError(
                f"{key}: {train.world_size} processes (train.nodes {train.nodes} x "
                f"train.nproc {train.nproc}) cannot share the "
                f"{micro_batches // train.minibatches} micro-batch(es) of an optimizer step "
                "evenly; change train.nodes, train.nproc, train.minibatches, "
                "sampler.prompts_per_round or batch_size"
            )

    def trained_steps_at_most(self) -> int:
        """The most trained steps a rollout of the sampler section can have."""
        sampler = self.sampler
        if sampler.trajectory == "segment":
            return sampler.segment_steps
        return max(1, round(sampler.trained_fraction * (sampler.num_steps - 1)))


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a run config strictly; errors name the file and the dotted key."""
    return _load_yaml(RunConfig, path, overrides)


def from_mapping(data: dict) -> RunConfig:
    """Build a run config from already-parsed data (e.g. Snakemake's ``config``)."""
    return from_dict(RunConfig, data)


def schema() -> dict:
    """The JSON Schema (draft 2020-12) of the run config."""
    return json_schema(RunConfig)


__all__ = [
    "REWARD_NAMES",
    "AdvantageConfig",
    "BackboneConfig",
    "BackboneDtype",
    "BackboneFamily",
    "ClipScoreConfig",
    "ConfigError",
    "EvalConfig",
    "GRPOConfig",
    "HPSv21Config",
    "JaggConfig",
    "JpegCompressibilityConfig",
    "LoraConfig",
    "PickScoreConfig",
    "RewardDtype",
    "RewardsConfig",
    "RunConfig",
    "SamplerConfig",
    "ToyAttributesConfig",
    "ToyClipScoreConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainingMode",
    "digest",
    "from_mapping",
    "load_config",
    "schema",
]
