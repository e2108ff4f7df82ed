"""FSDP2 and the diffusers modules that return views: the gradients stay right, the warning off.

FluxSingleTransformerBlock returns slices of its residual stream and the Flux and QwenImage
roots return nn.Linear's view of a 2-D matmul; FSDP2 warns about any such view, since an
in-place op on it can bypass its pre-backward hook. Nothing modifies them in place: float64
gradients of the sharded toy backbones (world size 1 here, 2 under torchrun) equal the
unwrapped model's, and ``shard_backbone`` filters the warning for exactly these modules.
"""

import json
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from train_helpers import REPO, launcher, subprocess_env

from jagg_pipeline.backbones import Backbone, load_backbone
from jagg_pipeline.bench.measure import save_bench_backbone
from jagg_pipeline.config.run import BackboneConfig
from jagg_pipeline.stages import distributed
from jagg_pipeline.toyworld.models import toy_backbone_options

FAMILIES = ("flux", "qwenimage")
# The modules that return a view, per family (the reason for the filter in distributed.py).
VIEW_MODULES = {
    "flux": ["FluxSingleTransformerBlock", "FluxTransformer2DModel"],
    "qwenimage": ["QwenImageTransformer2DModel"],
}
# Prompts of different lengths: QwenImage's padded text takes part through its mask.
PROMPTS = ["a red circle on the left, white background", "a blue square at the top"]
VIEW_WARNING = "returned a view tensor"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """The toy Flux and QwenImage pipelines (random weights), saved once."""
    root = tmp_path_factory.mktemp("toy-checkpoints")
    for family in FAMILIES:
        save_bench_backbone(f"toy-{family}", root / family)
    return root


def _load(checkpoints: Path, family: str, text: bool) -> Backbone:
    options = {**toy_backbone_options(family), "dtype": "float64"}
    path = str(checkpoints / family)
    return load_backbone(BackboneConfig(path=path, load_text_encoders=text, **options))


def _loss(backbone: Backbone, index: list[int], batch: dict[str, Any]) -> torch.Tensor:
    cond = {k: v[index] for k, v in batch["cond"].items()}
    v = backbone.velocity(batch["z"][index], batch["sigma"][index], cond)
    return (v * batch["weight"][index]).sum()


@contextmanager
def view_outputs(modules: list[nn.Module]) -> Iterator[set[str]]:
    """The classes of ``modules`` whose forward returned a view, while inside."""
    found: set[str] = set()

    def record(module: nn.Module, _args: Any, output: Any) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        if any(isinstance(t, torch.Tensor) and t._base is not None for t in outputs):
            found.add(type(module).__name__)

    handles = [module.register_forward_hook(record) for module in modules]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def gradient_report(checkpoints: Path, ctx: distributed.DistContext) -> dict[str, Any]:
    """Per family: the largest relative gradient difference between the sharded backbone
    (this rank's samples; FSDP2 sums over ranks) and the unwrapped one (every sample), the
    largest reference gradient, the view-returning modules and the view warnings seen."""
    report = {}
    for family in FAMILIES:
        reference = _load(checkpoints, family, text=True)
        gen = torch.Generator().manual_seed(0)
        z = torch.randn(len(PROMPTS), *reference.latent_shape, generator=gen, dtype=torch.float64)
        batch = {
            "z": z,
            "sigma": torch.tensor([0.3, 0.8], dtype=torch.float64),
            "cond": reference.encode_prompts(PROMPTS),
            "weight": torch.randn(z.shape, generator=gen, dtype=torch.float64),
        }
        with view_outputs([*reference.fsdp_units(), reference.transformer]) as views:
            _loss(reference, list(range(len(PROMPTS))), batch).backward()

        sharded = _load(checkpoints, family, text=False)
        distributed.shard_backbone(sharded, ctx)
        mine = list(range(ctx.rank, len(PROMPTS), ctx.world_size))
        with warnings.catch_warnings(record=True) as caught:
            _loss(sharded, mine, batch).backward()

        expected = [p.grad for p in reference.trainable_parameters()]
        got = [distributed.full_tensor(p.grad) for p in sharded.trainable_parameters()]
        report[family] = {
            "parameters": [len(expected), len(got)],
            "relative_difference": max(map(_relative_difference, got, expected)),
            "largest_gradient": max(float(e.abs().max()) for e in expected),
            "view_modules": sorted(views),
            "view_warnings": [str(w.message) for w in caught if VIEW_WARNING in str(w.message)],
        }
    return report


def _relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference over the largest expected entry; a zero gradient must stay zero
    (QwenImage's last block: its text queries reach only the discarded text stream)."""
    difference, scale = float((got - expected).abs().max()), float(expected.abs().max())
    return difference / scale if scale else (0.0 if difference == 0 else float("inf"))


def _check(report: dict[str, Any]) -> None:
    for family in FAMILIES:
        result = report[family]
        assert result["parameters"][0] == result["parameters"][1] > 0
        assert result["largest_gradient"] > 1e-3
        assert result["relative_difference"] <= 1e-12, (family, result["relative_difference"])
        assert result["view_modules"] == VIEW_MODULES[family]
        assert result["view_warnings"] == []


def test_one_rank_gradients_equal_the_unwrapped_model_and_the_filter_is_narrow(checkpoints):
    with distributed.distributed("cpu") as ctx:
        report = gradient_report(checkpoints, ctx)
        # Any other module returning a view still warns: nn.Linear on a 3-D input.
        probe = nn.Linear(4, 4, dtype=torch.float64)
        fully_shard(probe, mesh=ctx.mesh)
        with warnings.catch_warnings(record=True) as caught:
            probe(torch.ones(2, 3, 4, dtype=torch.float64)).sum().backward()
    _check(report)
    assert any(f"(FSDPLinear) {VIEW_WARNING}" in str(w.message) for w in caught)


@pytest.mark.slow
def test_two_ranks_gradients_equal_the_unwrapped_model(checkpoints, tmp_path):
    out = tmp_path / "report.json"
    command = [*launcher(2), str(Path(__file__).resolve()), str(checkpoints), str(out)]
    result = subprocess.run(
        command, env=subprocess_env(), capture_output=True, text=True, timeout=240, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-4000:]
    _check(json.loads(out.read_text()))


def _worker(checkpoints: Path, out: Path) -> None:
    torch.set_num_threads(1)
    with distributed.distributed("cpu") as ctx:
        report = gradient_report(checkpoints, ctx)
        if ctx.is_main:
            out.write_text(json.dumps(report))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
