"""The experiment configuration: one typed dataclass per section, loaded strictly from YAML.

Sections: ``backbone`` (:class:`~jagg_pipeline.backbones.base.BackboneSpec`), ``sampler``,
``advantage`` (read by the score stage only), ``grpo`` (the train stage's loss), ``jagg``,
``rewards`` (:data:`~jagg_pipeline.rewards.registry.RewardsSpec`, one field per registered
reward), ``train``, ``eval``, ``tracking``. The JSON Schema that
Snakemake validates config.yaml against is derived from these classes
(``python -m jagg_pipeline config schema``), so the two cannot drift apart. Defaults describe
the embedded toy world (DESIGN section 6). Knows nothing of torch beyond the section types.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jagg_pipeline.backbones.base import BackboneSpec
from jagg_pipeline.configtools import ConfigError, digest, field, from_dict, json_schema
from jagg_pipeline.configtools import load_yaml as _load_yaml
from jagg_pipeline.rewards.registry import RewardsSpec


@dataclass
class SamplerConfig:
    """How rollouts are sampled: schedule, SDE family, group size, which steps are trained."""

    num_steps: int = field(10, help="denoising steps of a rollout")
    step: Literal["flow_grpo", "dance_grpo", "cps"] = field(
        "flow_grpo", help="SDE step family (DESIGN section 3)"
    )
    noise_level: float = field(
        0.7, help="a of Flow-GRPO (0.7 SD3.5, 0.9 Flux, 1.2 QwenImage), eta of DanceGRPO, a of CPS"
    )
    group_size: int = field(8, help="samples per prompt (G of GRPO)")
    prompts_per_round: int = field(8, help="prompts sampled per training round")
    batch_size: int = field(16, help="samples per network forward during rollout")
    trajectory: Literal["full", "window"] = field(
        "window",
        help="'full': SDE on every step, train a selection; 'window': SDE on a window of "
        "consecutive steps, ODE elsewhere (Flow-GRPO-Fast / MixGRPO)",
    )
    trained_fraction: float = field(
        1.0, help="'full' only: fraction of steps trained (the last step never is)"
    )
    window_size: int = field(8, help="'window' only: consecutive SDE steps")
    window_start: list[int] = field(
        default_factory=lambda: [0, 0],
        help="'window' only: inclusive [lo, hi] range of the window's random first step",
    )

    def __post_init__(self) -> None:
        for name in ("num_steps", "group_size", "prompts_per_round", "batch_size", "window_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"sampler.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError("sampler.group_size must be >= 2: GRPO compares samples in a group")
        if len(self.window_start) != 2 or not 0 <= self.window_start[0] <= self.window_start[1]:
            raise ValueError(f"sampler.window_start must be [lo, hi], got {self.window_start}")
        if self.trajectory == "window" and self.window_start[1] + self.window_size > self.num_steps:
            raise ValueError(
                f"sampler.window_start {self.window_start} + window_size {self.window_size} "
                f"exceeds num_steps {self.num_steps}"
            )


@dataclass
class AdvantageConfig:
    """How the score stage turns rewards into GRPO advantages (train reads them from its table)."""

    std_mode: Literal["group", "global"] = field(
        "group", help="normalise advantages by each group's std or the batch's"
    )
    eps: float = field(1e-4, help="added to the std before dividing")
    clip: float = field(5.0, help="advantages are clipped to +-clip")


@dataclass
class GRPOConfig:
    """The clipped policy objective of the train stage."""

    clip_range: float = field(1e-4, help="PPO ratio clip e (1e-4 full trajectories, 1e-5 windows)")
    kl_beta: float = field(0.0, help="weight of the KL to the frozen reference policy (0: off)")


@dataclass
class JaggConfig:
    """Which gradient engine trains the windows of trained steps, and how they are routed."""

    mode: Literal["exact", "jagg", "no_interp"] = field(
        "jagg", help="exact baseline, JAGG, or the no-interpolation ablation"
    )
    window: int = field(4, help="W: trained steps per window (>= 2)")
    jagg_frac: float | Literal["auto"] = field(
        1.0,
        help="fraction of windows (from high noise) routed to the approximation, or 'auto' "
        "(route windows whose probed cos-sim clears auto_threshold)",
    )
    weights: Literal["time", "index"] = field(
        "time", help="interpolation weights: t-weights (correct) or index (ablation)"
    )
    no_interp: Literal["drop", "nearest"] = field(
        "drop", help="no_interp variant: drop interior signals or hand them to the nearer endpoint"
    )
    stack_forwards: bool = field(
        True,
        help="one stacked endpoint forward (fast); false keeps the rollout's batch composition "
        "so log-probs recompute bit for bit",
    )
    auto_threshold: float = field(0.8, help="'auto': minimum cos-sim to route a window to jagg")
    auto_every: int = field(10, help="'auto': re-probe every K rounds")
    auto_probe_groups: int = field(2, help="'auto': prompt groups in the probe batch")

    def engine_options(self) -> dict[str, Any]:
        """The options every gradient-engine call of a run takes (training and probes)."""
        return {
            "weights": self.weights,
            "no_interp": self.no_interp,
            "stack_forwards": self.stack_forwards,
        }

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"jagg.window must be >= 2, got {self.window}")
        if self.jagg_frac != "auto" and not 0.0 <= self.jagg_frac <= 1.0:
            raise ValueError(f"jagg.jagg_frac must be in [0, 1] or 'auto', got {self.jagg_frac}")


@dataclass
class TrainConfig:
    """The optimiser and the round loop."""

    rounds: int = field(30, help="training rounds (rollout -> score -> update)")
    lr: float = field(1e-4, help="AdamW learning rate (the toy world falls at 3e-4)")
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], help="AdamW betas")
    weight_decay: float = field(0.0, help="AdamW weight decay")
    grad_clip: float = field(1.0, help="max global grad norm (0: off)")
    lr_schedule: Literal["constant", "cosine", "linear"] = field(
        "constant", help="decay of the lr over all optimizer steps"
    )
    warmup_steps: int = field(0, help="linear warm-up steps")
    minibatches: int = field(1, help="optimizer steps per round (the round's groups are split)")
    ema_decay: float | None = field(None, help="EMA of the trained weights for evaluation")
    mixed_precision: Literal["no", "bf16"] = field(
        "no", help="FSDP2 MixedPrecisionPolicy: bf16 params, fp32 reduce"
    )
    nproc: int = field(1, help="processes (GPUs) per training job, under torchrun")
    seed: int = field(0, help="seed of prompts, noise and everything else random")


@dataclass
class EvalConfig:
    """Deterministic evaluation of a checkpoint."""

    num_steps: int = field(20, help="ODE steps at evaluation")
    prompts: str = field(
        "toy:heldout", help="a prompt file, or 'toy:heldout' / 'toy:train' for the toy world"
    )
    column: str | None = field(None, help="column of a tabular prompt file")
    max_prompts: int = field(39, help="evaluate at most this many prompts")
    samples_per_prompt: int = field(2, help="images per prompt")
    seed: int = field(1234, help="seed of the evaluation noise (fixed across checkpoints)")
    metrics: list[str] = field(
        default_factory=lambda: ["toy_attributes", "toy_clipscore"],
        help="reward names reported as metrics (their settings come from the rewards section)",
    )
    every: int = field(10, help="evaluate every K rounds (and the last)")


@dataclass
class TrackingConfig:
    """Where metrics go."""

    backend: Literal["mlflow", "none"] = field("mlflow", help="mlflow or none")
    uri: str = field("sqlite:///results/mlflow.db", help="MLflow tracking URI")
    experiment: str = field("jagg-toy", help="MLflow experiment name")


@dataclass
class ExperimentConfig:
    """A whole experiment: every section, defaults filled."""

    backbone: BackboneSpec = field(
        default_factory=lambda: BackboneSpec(
            family="sd3",
            path="results/toyworld/sd3",
            height=32,
            width=32,
            dtype="float32",
            training="full",
            max_sequence_length=16,
        ),
        help="the DiT checkpoint and how to drive it",
    )
    sampler: SamplerConfig = field(default_factory=SamplerConfig, help="rollout sampling")
    advantage: AdvantageConfig = field(
        default_factory=AdvantageConfig, help="group advantages (score stage)"
    )
    grpo: GRPOConfig = field(default_factory=GRPOConfig, help="policy loss (train stage)")
    jagg: JaggConfig = field(default_factory=JaggConfig, help="gradient engine and routing")
    rewards: RewardsSpec = field(
        default_factory=lambda: RewardsSpec(weights={"toy_attributes": 1.0}),
        help="training rewards and every reward model's settings",
    )
    train: TrainConfig = field(default_factory=TrainConfig, help="optimiser and rounds")
    eval: EvalConfig = field(default_factory=EvalConfig, help="evaluation")
    tracking: TrackingConfig = field(default_factory=TrackingConfig, help="metrics tracking")

    def __post_init__(self) -> None:
        if not self.rewards.weights:
            raise ValueError("rewards.weights: name at least one reward to train on")


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read an experiment config strictly; errors name the file and the dotted key."""
    return _load_yaml(ExperimentConfig, path, overrides)


def from_mapping(data: dict) -> ExperimentConfig:
    """Build an experiment config from already-parsed data (e.g. Snakemake's ``config``)."""
    return from_dict(ExperimentConfig, data)


def schema() -> dict:
    """The JSON Schema (draft 2020-12) of the experiment config."""
    return json_schema(ExperimentConfig)


__all__ = [
    "AdvantageConfig",
    "ConfigError",
    "EvalConfig",
    "ExperimentConfig",
    "GRPOConfig",
    "JaggConfig",
    "SamplerConfig",
    "TrackingConfig",
    "TrainConfig",
    "digest",
    "from_mapping",
    "load_config",
    "schema",
]
