"""The one declaration of the gradient engines' modes and options, torch-free.

The engines (:mod:`jagg_pipeline.core.jagg`) take one :class:`EngineOptions` record
(:data:`DEFAULT_OPTIONS` unless given); the run config's ``jagg`` section, the gradient
diagnostic's settings and its CLI flags copy each field (default, help text, choices) from
here with :func:`option_field` and :func:`option_choices`, so that none of them can drift
from what the engines do.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

GradMode = Literal["exact", "jagg", "no_interp"]
GRAD_MODES: tuple[str, ...] = typing.get_args(GradMode)
Weights = Literal["time", "index"]
NoInterpVariant = Literal["drop", "nearest"]
EndpointBackward = Literal["joint", "sequential"]
ENDPOINT_BACKWARDS: tuple[str, ...] = typing.get_args(EndpointBackward)
Anchors = Literal["separate", "shared"]
ANCHORS: tuple[str, ...] = typing.get_args(Anchors)


def _option(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineOptions:
    """How an engine computes a window's gradient (which windows it trains is the run's)."""

    anchors: Anchors = _option(
        "separate",
        "'separate': each window interpolates between its own two ends (2 rows per W steps); "
        "'shared': adjacent windows share their boundary step, so anchors come every W - 1 "
        "steps (about one row per W - 1 steps, the same interpolation span)",
    )
    weights: Weights = _option(
        "time", "interpolation weights: 'time' (correct) or 'index' (j/(W-1), the ablation)"
    )
    no_interp: NoInterpVariant = _option(
        "drop", "no_interp variant: drop interior signals, or hand each to the nearer endpoint"
    )
    stack_forwards: bool = _option(
        True,
        "one stacked endpoint forward (fast); false keeps the rollout's batch composition so "
        "log-probs recompute bit for bit",
    )
    endpoint_backward: EndpointBackward = _option(
        "sequential",
        "'sequential': each window endpoint's forward and backward on its own (the activation "
        "memory of exact, two backward calls); 'joint': one stacked forward and one backward "
        "(two endpoints' activations alive at once); the same gradient",
    )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names, in declaration order."""
        return tuple(declared.name for declared in dataclasses.fields(cls))


DEFAULT_OPTIONS = EngineOptions()


def _declared(name: str) -> dataclasses.Field:
    for declared in dataclasses.fields(EngineOptions):
        if declared.name == name:
            return declared
    raise KeyError(f"{name!r} is not an engine option ({', '.join(EngineOptions.names())})")


def option_field(name: str) -> Any:
    """A dataclass field with engine option ``name``'s default and help (for other settings)."""
    declared = _declared(name)
    return dataclasses.field(default=declared.default, metadata=dict(declared.metadata))


def option_help(name: str) -> str:
    """Engine option ``name``'s help text."""
    return _declared(name).metadata["help"]


def option_choices(name: str) -> tuple[Any, ...]:
    """The values engine option ``name`` takes (its Literal's), for CLI choices."""
    return typing.get_args(typing.get_type_hints(EngineOptions)[name])
