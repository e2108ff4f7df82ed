"""Small analytic velocity models for checking the gradient engines.

``affine``: v is affine in (z, sigma) while the parameters enter nonlinearly, so the
parameter-Jacobian J = dv/dtheta is affine in (z, sigma): JAGG is exact on chord points
(JAGG's exactness condition). ``mlp-dit``: a tiny DiT-shaped network (patch tokens,
adaLN modulation by time and condition, token- and channel-mixing MLPs) that is nonlinear
everywhere, so JAGG is only approximate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


class AffineVelocity(nn.Module):
    """v = tanh(P) Q z + sin(beta) sigma + gamma^3 + tanh(E) cond on a flattened latent."""

    def __init__(self, latent_shape: tuple[int, ...], cond_dim: int, rank: int = 8) -> None:
        super().__init__()
        self.latent_shape = latent_shape
        n = math.prod(latent_shape)
        self.P = nn.Parameter(torch.randn(n, rank) / math.sqrt(rank))
        self.Q = nn.Parameter(torch.randn(rank, n) / math.sqrt(n))
        self.beta = nn.Parameter(torch.randn(n))
        self.gamma = nn.Parameter(0.5 * torch.randn(n))
        self.E = nn.Parameter(torch.randn(n, cond_dim) / math.sqrt(cond_dim))

    def forward(self, z: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        flat = z.reshape(z.shape[0], -1)
        v = (
            flat @ (torch.tanh(self.P) @ self.Q).T
            + sigma[:, None] * torch.sin(self.beta)
            + self.gamma**3
            + cond @ torch.tanh(self.E).T
        )
        return v.reshape(z.shape)


def timestep_embedding(sigma: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """Sinusoidal features of ``scale * sigma`` (the usual DiT timestep embedding)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=sigma.dtype) / half)
    angles = scale * sigma[:, None] * freqs[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


class _Block(nn.Module):
    def __init__(self, hidden: int, tokens: int) -> None:
        super().__init__()
        self.modulation = nn.Linear(hidden, 6 * hidden)
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.token_mlp = nn.Sequential(
            nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens)
        )
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.channel_mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )

    def forward(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(c)[:, None].chunk(6, dim=-1)
        mixed = self.token_mlp((self.norm1(h) * (1 + scale1) + shift1).transpose(1, 2))
        h = h + gate1 * mixed.transpose(1, 2)
        return h + gate2 * self.channel_mlp(self.norm2(h) * (1 + scale2) + shift2)


class MlpDiT(nn.Module):
    """A DiT in miniature without attention: patchify, adaLN blocks, unpatchify."""

    def __init__(
        self,
        latent_shape: tuple[int, int, int],
        cond_dim: int,
        patch: int = 2,
        hidden: int = 32,
        depth: int = 2,
    ) -> None:
        super().__init__()
        channels, height, width = latent_shape
        if height % patch or width % patch:
            raise ValueError(f"latent {latent_shape} is not divisible by patch {patch}")
        self.latent_shape = latent_shape
        self.patch = patch
        tokens = (height // patch) * (width // patch)
        self.embed = nn.Linear(channels * patch * patch, hidden)
        self.pos = nn.Parameter(0.02 * torch.randn(1, tokens, hidden))
        self.time = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.cond = nn.Linear(cond_dim, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, tokens) for _ in range(depth))
        self.final_modulation = nn.Linear(hidden, 2 * hidden)
        self.final_norm = nn.LayerNorm(hidden, elementwise_affine=False)
        self.out = nn.Linear(hidden, channels * patch * patch)
        self.hidden = hidden

    def forward(self, z: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        p = self.patch
        tokens = nn.functional.pixel_unshuffle(z, p).flatten(2).transpose(1, 2)
        h = self.embed(tokens) + self.pos
        c = nn.functional.silu(self.time(timestep_embedding(sigma, self.hidden)) + self.cond(cond))
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.final_modulation(c)[:, None].chunk(2, dim=-1)
        out = self.out(self.final_norm(h) * (1 + scale) + shift)
        _, height, width = self.latent_shape
        grid = out.transpose(1, 2).reshape(z.shape[0], -1, height // p, width // p)
        return nn.functional.pixel_shuffle(grid, p)


@dataclass
class AnalyticBackbone:
    """A velocity network with the shapes a caller needs to drive it."""

    name: str
    module: nn.Module
    latent_shape: tuple[int, ...]
    cond_dim: int

    @property
    def velocity(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        return self.module

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Every parameter (the same accessor as the diffusers adapters')."""
        return list(self.module.parameters())


ANALYTIC_BACKBONES: tuple[str, ...] = ("affine", "mlp-dit")


def build_analytic(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    latent_shape: tuple[int, int, int] = (4, 4, 4),
    cond_dim: int = 8,
) -> AnalyticBackbone:
    """Build ``affine`` or ``mlp-dit`` deterministically from ``seed``."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if name == "affine":
            module: nn.Module = AffineVelocity(latent_shape, cond_dim)
        elif name == "mlp-dit":
            module = MlpDiT(latent_shape, cond_dim)
        else:
            raise ValueError(
                f"unknown analytic backbone {name!r}; choose from {ANALYTIC_BACKBONES}"
            )
    finally:
        torch.random.set_rng_state(generator_state)
    return AnalyticBackbone(name, module.to(dtype), latent_shape, cond_dim)
