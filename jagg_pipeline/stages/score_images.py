"""Scoring a folder of images against their prompts: the logic behind ``score-images``.

Owns pairing images with prompts (:class:`ImageInputs`: a prompt file, image ``i`` taking
prompt ``i // images_per_prompt`` of the sorted files, or a table of image paths and prompts),
the ``rewards`` section built from a rewards file, weights and ``rewards.*`` overrides
(:func:`rewards_section`), scoring in batches of equal image size (:func:`score_columns`), and
the output (:func:`score_images`): one table row per image (``image``, ``prompt``, ``group``,
one column per reward, ``total``, ``advantage``; csv, jsonl or parquet from the suffix),
written atomically, and ``OUT.manifest.json`` beside it. That manifest is this command's own
format (command, version, resolved rewards, device, digests of the images and input files,
rows, table), not the stage contract of :mod:`jagg_pipeline.io.manifest`: there is no
run config to digest, and the images digested are the scored ones in input order, not
a folder's files. Errors a user can fix are :class:`ScoreImagesError` (an ``InputError``);
their messages keep the command's option names (``--images``, ``--out``), its one caller.
The pipeline's score stage on a rollout is :mod:`jagg_pipeline.stages.scoring`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jagg_pipeline import __version__
from jagg_pipeline.config.fields import to_dict
from jagg_pipeline.config.yaml_io import apply_overrides, read_yaml
from jagg_pipeline.io.artifacts import atomic_write_json
from jagg_pipeline.io.manifest import file_sha256, manifest_path
from jagg_pipeline.io.prompts import column_values, load_prompts, read_table
from jagg_pipeline.io.tables import WRITE_SUFFIXES, write_table
from jagg_pipeline.rewards import MultiReward, parse_rewards, to_unit_float
from jagg_pipeline.support.errors import InputError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class ScoreImagesError(InputError):
    """An image folder, pairing or rewards file that cannot be scored; names it."""


@dataclass
class Sample:
    """One image to score: its file, the name written to the table, its prompt."""

    path: Path
    name: str
    prompt: str


@dataclass
class ImageScores:
    """What :func:`score_images` wrote: the table, its manifest, the rows, the rewards run."""

    table: Path
    manifest: Path
    rows: list[dict[str, Any]]
    rewards: list[str]


def rewards_section(
    file: Path | None = None,
    weights: Mapping[str, float] | None = None,
    normalize_separately: bool | None = None,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """The ``rewards`` section from a YAML/JSON ``file``, then ``weights``, then ``overrides``.

    ``file`` holds the section or a config with a ``rewards:`` key; ``weights`` replace its
    weights; ``overrides`` are ``rewards.KEY.PATH=VALUE`` items (no other section applies).
    """
    section: dict[str, Any] = {}
    if file is not None:
        loaded = read_yaml(file)
        if isinstance(loaded, dict) and "rewards" in loaded:
            loaded = loaded["rewards"]
        if not isinstance(loaded, dict):
            raise ScoreImagesError(f"{file}: expected a mapping of reward settings")
        section = dict(loaded)
    if weights:
        section["weights"] = dict(weights)
    if normalize_separately is not None:
        section["normalize_separately"] = normalize_separately
    outside = [item for item in overrides if not item.startswith("rewards.")]
    if outside:
        raise ScoreImagesError(f"--set {outside[0]}: only rewards.* keys apply to images")
    return apply_overrides({"rewards": section}, overrides)["rewards"]


def image_files(folder: Path) -> list[Path]:
    """The images of ``folder`` (by suffix), sorted by file name."""
    if not folder.is_dir():
        raise ScoreImagesError(f"--images {folder}: no such folder")
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


@dataclass
class ImageInputs:
    """A folder of images and how they pair with prompts: a prompt file or a table.

    With ``prompts`` the sorted images take ``images_per_prompt`` consecutive images per
    prompt (the counts must match); else ``manifest`` is a table whose ``image_column`` names
    files relative to ``images`` and whose ``column`` (default ``prompt``) holds the prompts.
    """

    images: Path
    prompts: Path | None = None
    manifest: Path | None = None
    column: str | None = None
    image_column: str = "image"
    images_per_prompt: int = 1

    def samples(self) -> list[Sample]:
        """The images paired with their prompts, in table (or file name) order."""
        if self.prompts is not None:
            texts = load_prompts(self.prompts, self.column)
            files = image_files(self.images)
            k = self.images_per_prompt
            if k < 1 or len(files) != k * len(texts):
                raise ScoreImagesError(
                    f"{len(files)} images in {self.images} but {len(texts)} prompts in "
                    f"{self.prompts} with --images-per-prompt {k}: need {k * len(texts)}"
                )
            return [Sample(f, f.name, texts[i // k]) for i, f in enumerate(files)]
        if self.manifest is None:
            raise ScoreImagesError("give a prompt file or a manifest table to pair images with")
        rows = read_table(self.manifest)
        names = column_values(self.manifest, rows, self.image_column)
        texts = column_values(self.manifest, rows, self.column or "prompt")
        pairs = zip(names, texts, strict=True)
        samples = [Sample(self.images / str(n), str(n), str(p)) for n, p in pairs]
        missing = [s.name for s in samples if not s.path.is_file()]
        if missing:
            raise ScoreImagesError(
                f"{len(missing)} images of {self.manifest} not found in {self.images}, "
                f"e.g. {missing[0]}"
            )
        return samples


def score_columns(
    reward: MultiReward, samples: Sequence[Sample], batch_size: int
) -> dict[str, torch.Tensor]:
    """Score every sample; images of one size are batched together, rows keep input order."""
    from PIL import Image

    by_size: dict[tuple[int, int], list[int]] = {}
    for index, sample in enumerate(samples):
        try:
            with Image.open(sample.path) as image:
                image.verify()  # a truncated or non-image file fails here, before any scoring
                by_size.setdefault(image.size, []).append(index)
        except (OSError, SyntaxError) as err:  # PIL raises both for unreadable images
            raise ScoreImagesError(f"{sample.path}: not a readable image ({err})") from None
    columns = {name: torch.empty(len(samples)) for name in reward.rewards}
    for indices in by_size.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            images = []
            for i in chunk:
                with Image.open(samples[i].path) as image:
                    images.append(image.convert("RGB"))
            scores = reward.columns(to_unit_float(images), [samples[i].prompt for i in chunk])
            for name, values in scores.items():
                columns[name][chunk] = values.cpu()
    return columns


def _image_digest(samples: Sequence[Sample]) -> str:
    """sha256 over each scored image's table name and file digest, in input order."""
    h = hashlib.sha256()
    for sample in samples:
        h.update(f"{sample.name}\0{file_sha256(sample.path)}\n".encode())
    return h.hexdigest()


def score_images(
    inputs: ImageInputs,
    rewards: Mapping[str, Any],
    out: Path,
    *,
    device: str = "cpu",
    batch_size: int = 32,
    rewards_file: Path | None = None,
) -> ImageScores:
    """Score the images of ``inputs`` with the ``rewards`` section; write the table ``out``.

    Images of one prompt form one group. ``out`` ends in .csv, .jsonl or .parquet;
    ``OUT.manifest.json`` records the digests of the images, of the prompt file or table and
    of ``rewards_file`` (the file the section was read from, if any). Returns what it wrote.
    """
    if out.suffix.lower() not in WRITE_SUFFIXES:
        raise ScoreImagesError(f"--out {out}: use one of {', '.join(WRITE_SUFFIXES)}")
    if batch_size < 1:
        raise ScoreImagesError(f"--batch-size must be >= 1, got {batch_size}")
    spec = parse_rewards(rewards)
    samples = inputs.samples()
    if not samples:
        raise ScoreImagesError(f"no images to score in {inputs.images}")
    reward = MultiReward.from_spec(spec, device)
    columns = score_columns(reward, samples, batch_size)
    groups: dict[str, int] = {}
    group_ids = torch.tensor([groups.setdefault(s.prompt, len(groups)) for s in samples])
    result = reward.combine(columns, group_ids)
    rows = [
        {
            "image": sample.name,
            "prompt": sample.prompt,
            "group": int(group_ids[i]),
            **{name: float(values[i]) for name, values in result.columns.items()},
            "total": float(result.total[i]),
            "advantage": float(result.advantages[i]),
        }
        for i, sample in enumerate(samples)
    ]
    write_table(out, rows)
    text_inputs = [p for p in (inputs.prompts, inputs.manifest, rewards_file) if p is not None]
    record = {
        "command": "score",
        "version": __version__,
        "rewards": to_dict(spec),
        "device": device,
        "inputs": {
            "images": str(inputs.images),
            "images_sha256": _image_digest(samples),
            "files_sha256": {str(p): file_sha256(p) for p in text_inputs},
        },
        "rows": len(rows),
        "table": out.name,
    }
    written = atomic_write_json(manifest_path(out), record)
    return ImageScores(out, written, rows, list(spec.weights))
