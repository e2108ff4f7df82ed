"""Peak host memory of loads sized to the shard: a ~0.5B-parameter Flux on 2 gloo ranks.

The pipeline is the tiny Flux with its transformer replaced by a ``FluxTransformer2DModel``
of about 5e8 parameters (the shape ``benchmarks/scale_rehearsal.py`` picks for ``--params
5e8``), random bfloat16 weights written with safetensors in diffusers' sharded layout (files
of at most 256 MB and the index json); the backbone loads it in float32, so each of the 2
ranks holds about 1 GB of it. Each load runs in its own ``torchrun`` job, so the kernel's
high-water mark ``VmHWM`` at its end is the load's peak; the RSS after the imports
(everything the load imports, imported first) is the baseline. The target, per rank, for
the training load and for the sampling load: peak <= imports + the rank's shard + 1.5 GB.

Run as a script under torchrun it is the worker: ``python test_load_memory.py PIPELINE OUT
PURPOSE PATH`` with PURPOSE ``training`` or ``sampling`` and PATH ``sharded``
(:func:`~jagg_pipeline.stages.policy.load_sharded_policy`) or ``whole`` (the path it
replaced: the whole model on every rank, sharded afterwards for training: the figure
docs/scale.md quotes beside it). Each rank writes ``OUT.<rank>.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import REPO, launcher, subprocess_env

GB = 1e9
EXTRA = 1.5 * GB  # the target: peak <= imports + shard + EXTRA
PARAMS = 5e8
FILE_BYTES = 256 << 20


def build_pipeline(root: Path, params: float = PARAMS) -> Path:
    """The tiny Flux pipeline with a ~``params``-parameter transformer, random bf16 weights."""
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from jagg_pipeline.backbones.loading import WEIGHTS_INDEX, WEIGHTS_NAME
    from jagg_pipeline.toyworld.tiny import save_tiny_pipeline

    sys.path.insert(0, str(REPO / "benchmarks"))
    from _common import choose_flux

    pipeline = save_tiny_pipeline("flux", root / "flux-0.5b")
    folder = pipeline / "transformer"
    for old in folder.iterdir():
        old.unlink()
    with torch.device("meta"):
        model = FluxTransformer2DModel(**choose_flux(params)["kwargs"])
    model.save_config(folder)
    # Files of about FILE_BYTES, in parameter order, and the index mapping names to them.
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    part: dict[str, torch.Tensor] = {}
    named = list(model.named_parameters())
    for number, (name, param) in enumerate(named):
        part[name] = (torch.randn(param.shape, generator=generator) * 0.02).to(torch.bfloat16)
        if sum(t.numel() * 2 for t in part.values()) >= FILE_BYTES or number == len(named) - 1:
            file = f"diffusion_pytorch_model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(part, str(folder / file))
            weight_map.update(dict.fromkeys(part, file))
            part = {}
    total = sum(p.numel() * 2 for _, p in named)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=1))
    assert not (folder / WEIGHTS_NAME).exists()
    return pipeline


def _status(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _worker(pipeline: Path, out: Path, purpose: str, path: str) -> None:
    # Everything the load imports, imported before the baseline.
    import diffusers  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: F401

    from jagg_pipeline.config.run import from_mapping
    from jagg_pipeline.io.shards import local_tensor
    from jagg_pipeline.stages import distributed
    from jagg_pipeline.stages.policy import load_policy, load_sharded_policy

    torch.set_num_threads(1)
    backbone = {"family": "flux", "path": str(pipeline), "dtype": "float32"}
    config = from_mapping({"backbone": backbone, "tracking": {"backend": "none"}})
    training = purpose == "training"
    with distributed.distributed("cpu") as ctx:
        imports = _status("VmRSS")
        if path == "sharded":
            policy = load_sharded_policy(config, "base", ctx, for_training=training)
        else:  # today's path: the whole model, sharded after it loaded (training only)
            policy = load_policy(config, "base", ctx.device, for_training=training)
            if training:
                distributed.shard_backbone(policy, ctx)
        peak = _status("VmHWM")
        shard = sum(
            local_tensor(p).numel() * p.element_size() for p in policy.transformer.parameters()
        )
        report = {"imports": imports, "peak": peak, "shard": shard, "after": _status("VmRSS")}
        distributed.barrier()
    Path(f"{out}.{os.environ['RANK']}.json").write_text(json.dumps(report))


def measure(pipeline: Path, out: Path, purpose: str, path: str) -> list[dict[str, Any]]:
    """One load in its own 2-rank torchrun job; each rank's report."""
    command = [*launcher(2), __file__, str(pipeline), str(out), purpose, path]
    result = subprocess.run(
        command, env=subprocess_env(), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_a_sharded_load_peaks_below_imports_plus_the_shard_plus_1_5_gb(tmp_path):
    pipeline = build_pipeline(tmp_path)
    for purpose in ("training", "sampling"):
        reports = measure(pipeline, tmp_path / purpose, purpose, "sharded")
        for rank, report in enumerate(reports):
            print(purpose, rank, {k: round(v / GB, 3) for k, v in report.items()})
            assert 0.9 * GB < report["shard"] < 1.1 * GB  # half of ~2 GB of float32
            assert report["peak"] <= report["imports"] + report["shard"] + EXTRA, (purpose, rank)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4])
