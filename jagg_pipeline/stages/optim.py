"""The optimizer side of training: AdamW, the learning-rate schedule, the EMA of the weights.

The schedule spans ``train.rounds * train.minibatches`` optimizer steps: the round count has
one source, the config. Its shape (``lr_schedule``, ``warmup_steps``:
:func:`~jagg_pipeline.config.run.lr_factor`) comes from the config too, its position from the
checkpoint. Knows nothing of rollouts or GRPO.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from jagg_pipeline.config.run import lr_factor


class Ema:
    """Exponential moving average of the trainable weights, sharded like them.

    ``shadow`` is the sharded state (names as the parameters'): the checkpoint saves it and
    loads a saved one into it in place.
    """

    def __init__(self, params: dict[str, torch.Tensor], decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"train.ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in params.items()}

    @torch.no_grad()
    def update(self, params: dict[str, torch.Tensor]) -> None:
        for name, p in params.items():
            self.shadow[name].lerp_(p.detach(), 1.0 - self.decay)


def build_optimizer(
    params: Sequence[torch.nn.Parameter], train: Any
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` and its schedule, from the ``train`` section."""
    optimizer = torch.optim.AdamW(
        params, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay
    )
    # A partial's state is not saved: the schedule is rebuilt from the config each round and
    # its position restored from the checkpoint.
    factor = functools.partial(
        lr_factor,
        total=train.rounds * train.minibatches,
        warmup=train.warmup_steps,
        kind=train.lr_schedule,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
