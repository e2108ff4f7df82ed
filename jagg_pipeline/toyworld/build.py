"""Building the toy world: a pretrained toy backbone, the toy CLIP, a report and pictures.

``build_toyworld(out, settings)`` writes, under ``out``:

- ``<family>/``: the pretrained toy checkpoint (diffusers format; the adapters load it);
- ``clip/``: the toy CLIP (transformers format; the CLIPScore code path loads it), built once
  and reused by later builds with the same CLIP settings;
- ``report-<family>.json``: the numbers (attribute reward of random init, base policy and the
  data itself on held-out captions; toy CLIPScore of each; CLIP retrieval top-1; timings);
- ``samples-<family>.png`` (base-policy images with their prompts), ``loss-<family>.png``.

Every directory is written under a temporary name and renamed into place when complete, with a
manifest, so a killed build leaves nothing that looks finished.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from jagg_pipeline import sde
from jagg_pipeline.artifacts import atomic_directory, atomic_write_json
from jagg_pipeline.backbones import BackboneSpec, backbone_class
from jagg_pipeline.backbones.base import Backbone
from jagg_pipeline.configtools import digest
from jagg_pipeline.plots import save_curves, save_image_grid
from jagg_pipeline.rewards import load_reward, parse_spec, to_unit_float
from jagg_pipeline.rewards.base import to_uint8
from jagg_pipeline.toyworld import data
from jagg_pipeline.toyworld.clip import (
    build_clip,
    retrieval_top1,
    save_clip,
    train_clip,
)
from jagg_pipeline.toyworld.models import build_toy_pipeline, toy_backbone_options
from jagg_pipeline.toyworld.pretrain import pretrain
from jagg_pipeline.toyworld.settings import BuildSettings, ClipSettings


def _bar(total: int, description: str, enabled: bool) -> Any:
    import sys

    from tqdm.auto import tqdm

    # Redirected to a log, a bar would write a line per update: refresh rarely there.
    interval = 0.1 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, desc=description, disable=not enabled, mininterval=interval)


@torch.no_grad()
def sample_images(backbone: Backbone, captions: list[str], steps: int, seed: int) -> torch.Tensor:
    """ODE samples (uint8) of ``captions``, one per caption, noise from ``seed``."""
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(captions))]
    x_init = torch.cat([backbone.initial_noise(1, g) for g in generators])
    masks = sde.StepMasks(
        sde=torch.zeros(steps, dtype=torch.bool), train=torch.zeros(steps, dtype=torch.bool)
    )
    ode = sde.StepCoefficients("ode", 0.0)
    trajectory = sde.sample(
        backbone.velocity,
        backbone.encode_prompts(captions),
        x_init,
        backbone.sigmas(steps),
        masks,
        ode,
    )
    return to_uint8(backbone.decode(trajectory.latents[:, -1]))


def ensure_clip(out: Path, settings: ClipSettings, progress: bool = True) -> dict[str, Any]:
    """Train and save the toy CLIP into ``out/clip`` unless a build with these settings is there."""
    final = out / "clip"
    wanted = digest(settings)
    manifest = final / "manifest.json"
    if manifest.is_file():
        import json

        previous = json.loads(manifest.read_text())
        if previous.get("settings_digest") == wanted:
            return previous["report"]
    model, processor = build_clip(settings)
    with _bar(settings.steps, "toy CLIP", progress) as bar:
        result = train_clip(model, processor, settings, bar)
    report = {
        "top1_16": retrieval_top1(model, processor),
        "seconds": result.seconds,
        "final_loss": sum(result.losses[-20:]) / min(20, len(result.losses)),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    with atomic_directory(final) as tmp:
        save_clip(model, processor, tmp)
        save_curves(tmp / "loss.png", {"contrastive loss": result.losses}, title="toy CLIP")
        atomic_write_json(
            tmp / "manifest.json",
            {
                "stage": "toyworld-clip",
                "settings": dataclasses.asdict(settings),
                "settings_digest": wanted,
                "report": report,
            },
        )
    return report


def build_toyworld(
    out: str | Path, settings: BuildSettings, progress: bool = True
) -> dict[str, Any]:
    """Build the CLIP (if needed) and the ``settings.family`` backbone; returns the report."""
    out = Path(out)
    clip_report = ensure_clip(out, settings.clip, progress)
    # The report scores with the registered rewards, the code path training and evaluation use.
    attributes = load_reward("toy_attributes")
    clip_score = load_reward(
        "toy_clipscore", parse_spec("toy_clipscore", {"model": str(out / "clip")})
    )

    family = settings.family
    pipeline = build_toy_pipeline(family, settings.seed)
    spec = BackboneSpec(path=str(out / family), **toy_backbone_options(family))
    backbone = backbone_class(family)(spec, dict(pipeline.components), out / family)

    held = data.split()[1]
    captions = [a.caption() for a in held for _ in range(settings.eval_per_caption)]
    gen = torch.Generator().manual_seed(settings.seed + 7)
    real = torch.stack([data.render(data.parse_caption(c), gen) for c in captions])

    def measure(images: torch.Tensor) -> dict[str, float]:
        pixels = to_unit_float(images)
        return {
            "attribute_reward": float(attributes(pixels, captions).mean()),
            "toy_clipscore": float(clip_score(pixels, captions).mean()),
        }

    eval_seed = settings.seed + 1000
    random_init = measure(sample_images(backbone, captions, settings.eval_steps, eval_seed))
    with _bar(settings.pretrain.steps, f"pretrain {family}", progress) as bar:
        result = pretrain(backbone, dataclasses.replace(settings.pretrain, seed=settings.seed), bar)
    base_images = sample_images(backbone, captions, settings.eval_steps, eval_seed)
    report = {
        "family": family,
        "seed": settings.seed,
        "held_out_captions": len(held),
        "samples": len(captions),
        "random_init": random_init,
        "base_policy": measure(base_images),
        "data": measure(real),
        "clip": clip_report,
        "pretrain": {
            "steps": settings.pretrain.steps,
            "batch": settings.pretrain.batch,
            "seconds": result.seconds,
            "final_loss": sum(result.losses[-50:]) / min(50, len(result.losses)),
            "transformer_parameters": sum(p.numel() for p in backbone.transformer.parameters()),
        },
        "settings": dataclasses.asdict(settings),
    }

    with atomic_directory(out / family) as tmp:
        pipeline.save_pretrained(tmp)
        atomic_write_json(
            tmp / "manifest.json",
            {"stage": "toyworld-backbone", "settings_digest": digest(settings), "report": report},
        )
    order = torch.arange(0, len(captions), settings.eval_per_caption)[:16]
    save_image_grid(out / f"samples-{family}.png", base_images[order], [captions[i] for i in order])
    save_curves(
        out / f"loss-{family}.png", {family: result.losses}, title=f"toy {family} pretraining"
    )
    atomic_write_json(out / f"report-{family}.json", report)
    return report
