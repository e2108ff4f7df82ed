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

The backbone's part that needs no CLIP (random initialisation, its samples, pretraining, the
base policy's samples) is :func:`pretrain_backbone`, which writes ``pretrain-<family>/``;
:func:`finish_backbone` scores those samples with the CLIP and writes the outputs above. The
workflow runs them as two jobs so that the CLIP trains beside the pretraining (the local profile
has two cores); :func:`build_toyworld` runs both in one process. Either way the outputs are the
same bytes, except the timings in the reports.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from jagg_pipeline.backbones import BackboneConfig, backbone_class
from jagg_pipeline.backbones.base import Backbone
from jagg_pipeline.config.fields import digest
from jagg_pipeline.core import sde
from jagg_pipeline.io.artifacts import atomic_directory, atomic_write_json
from jagg_pipeline.io.figures import save_curves, save_image_grid
from jagg_pipeline.io.manifest import listed_files
from jagg_pipeline.rewards import load_reward, parse_spec, to_unit_float
from jagg_pipeline.rewards import toy_scene as data
from jagg_pipeline.rewards.base import to_uint8
from jagg_pipeline.toyworld.clip import (
    build_clip,
    retrieval_top1,
    save_clip,
    train_clip,
)
from jagg_pipeline.toyworld.config import BuildConfig, ToyClipConfig
from jagg_pipeline.toyworld.models import build_toy_pipeline, toy_backbone_options
from jagg_pipeline.toyworld.pretrain import pretrain

# pretrain_backbone's files beside the pipeline: the report's samples, the pretraining's numbers.
_SAMPLES = "samples.safetensors"
_PRETRAIN = "pretrain.json"


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


def ensure_clip(out: Path, settings: ToyClipConfig, progress: bool = True) -> dict[str, Any]:
    """Train and save the toy CLIP into ``out/clip`` unless a build with these settings is there."""
    final = out / "clip"
    wanted = digest(settings)
    manifest = final / "manifest.json"
    if manifest.is_file():
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
                **listed_files(tmp),
            },
        )
    return report


def staged_folder(out: str | Path, family: str) -> Path:
    """Where :func:`pretrain_backbone` leaves ``family``'s pretrained pipeline and samples."""
    return Path(out) / f"pretrain-{family}"


def _eval_captions(settings: BuildConfig) -> list[str]:
    """The held-out captions the report samples, each ``eval_per_caption`` times."""
    return [a.caption() for a in data.split()[1] for _ in range(settings.eval_per_caption)]


def pretrain_backbone(out: str | Path, settings: BuildConfig, progress: bool = True) -> Path:
    """Pretrain ``settings.family`` into :func:`staged_folder`; returns that folder.

    It holds the pipeline as ``save_pretrained`` writes it (``pipeline/``), the report's
    samples of the random initialisation and of the base policy (``samples.safetensors``,
    uint8) and the loss curve with the pretraining's numbers (``pretrain.json``).
    """
    out = Path(out)
    family = settings.family
    pipeline = build_toy_pipeline(family, settings.seed)
    spec = BackboneConfig(path=str(out / family), **toy_backbone_options(family))
    backbone = backbone_class(family)(spec, dict(pipeline.components), out / family)

    captions = _eval_captions(settings)
    eval_seed = settings.seed + 1000
    random_init = sample_images(backbone, captions, settings.eval_steps, eval_seed)
    with _bar(settings.pretrain.steps, f"pretrain {family}", progress) as bar:
        result = pretrain(backbone, dataclasses.replace(settings.pretrain, seed=settings.seed), bar)
    base_policy = sample_images(backbone, captions, settings.eval_steps, eval_seed)
    staged = staged_folder(out, family)
    with atomic_directory(staged) as tmp:
        pipeline.save_pretrained(tmp / "pipeline")
        save_file({"random_init": random_init, "base_policy": base_policy}, tmp / _SAMPLES)
        atomic_write_json(
            tmp / _PRETRAIN,
            {
                "settings_digest": digest(settings),
                "losses": result.losses,
                "seconds": result.seconds,
                "transformer_parameters": sum(p.numel() for p in backbone.transformer.parameters()),
            },
        )
    return staged


def finish_backbone(
    out: str | Path, settings: BuildConfig, progress: bool = True
) -> dict[str, Any]:
    """Score :func:`pretrain_backbone`'s samples, write the checkpoint and report; the report.

    Trains the CLIP first if no build with ``settings.clip`` is there (the workflow builds it
    in its own job).
    """
    out = Path(out)
    family = settings.family
    staged = staged_folder(out, family)
    pretrained = json.loads((staged / _PRETRAIN).read_text())
    if pretrained["settings_digest"] != digest(settings):
        raise ValueError(
            f"{staged} was pretrained with other settings than this build's: rerun "
            "`toyworld pretrain` with them"
        )
    clip_report = ensure_clip(out, settings.clip, progress)
    # The report scores with the registered rewards, the code path training and evaluation use.
    attributes = load_reward("toy_attributes")
    clip_score = load_reward(
        "toy_clipscore", parse_spec("toy_clipscore", {"model": str(out / "clip")})
    )
    captions = _eval_captions(settings)
    gen = torch.Generator().manual_seed(settings.seed + 7)
    real = torch.stack([data.render(data.parse_caption(c), gen) for c in captions])

    def measure(images: torch.Tensor) -> dict[str, float]:
        pixels = to_unit_float(images)
        return {
            "attribute_reward": float(attributes(pixels, captions).mean()),
            "toy_clipscore": float(clip_score(pixels, captions).mean()),
        }

    samples = load_file(staged / _SAMPLES)
    losses = pretrained["losses"]
    report = {
        "family": family,
        "seed": settings.seed,
        "held_out_captions": len(data.split()[1]),
        "samples": len(captions),
        "random_init": measure(samples["random_init"]),
        "base_policy": measure(samples["base_policy"]),
        "data": measure(real),
        "clip": clip_report,
        "pretrain": {
            "steps": settings.pretrain.steps,
            "batch": settings.pretrain.batch,
            "seconds": pretrained["seconds"],
            "final_loss": sum(losses[-50:]) / min(50, len(losses)),
            "transformer_parameters": pretrained["transformer_parameters"],
        },
        "settings": dataclasses.asdict(settings),
    }

    with atomic_directory(out / family) as tmp:
        shutil.copytree(staged / "pipeline", tmp, dirs_exist_ok=True)
        atomic_write_json(
            tmp / "manifest.json",
            {
                "stage": "toyworld-backbone",
                "settings_digest": digest(settings),
                "report": report,
                **listed_files(tmp),
            },
        )
    order = torch.arange(0, len(captions), settings.eval_per_caption)[:16]
    save_image_grid(
        out / f"samples-{family}.png",
        samples["base_policy"][order],
        [captions[i] for i in order],
    )
    save_curves(out / f"loss-{family}.png", {family: losses}, title=f"toy {family} pretraining")
    atomic_write_json(out / f"report-{family}.json", report)
    return report


def build_toyworld(out: str | Path, settings: BuildConfig, progress: bool = True) -> dict[str, Any]:
    """Build the CLIP (if needed) and the ``settings.family`` backbone; returns the report.

    Finishes from a :func:`pretrain_backbone` folder with these settings where there is one
    (the workflow's pretraining job made it, and removes it); otherwise pretrains here and
    removes the folder once the outputs are in.
    """
    out = Path(out)
    ensure_clip(out, settings.clip, progress)
    staged = staged_folder(out, settings.family)
    pretrained = staged / _PRETRAIN
    made_here = not (
        pretrained.is_file()
        and json.loads(pretrained.read_text())["settings_digest"] == digest(settings)
    )
    if made_here:
        pretrain_backbone(out, settings, progress)
    report = finish_backbone(out, settings, progress)
    if made_here:
        shutil.rmtree(staged)
    return report
