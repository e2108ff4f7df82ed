"""Outputs are readable as the umask says, whichever writer made them.

safetensors' ``save_file`` makes its files private (0600) and so does ``mkstemp``: on a
shared filesystem the group could not read rollouts, checkpoints or exports. Under umask 022
every file a round writes (rollout shards, scores, the checkpoint's shards and
``trainer/rng.safetensors``, its export) is 0644 and every folder 0755, and so are a LoRA
adapter's files written outside any atomic folder.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from train_helpers import make_config

UMASK = 0o022


@pytest.fixture
def umask() -> Iterator[int]:
    """The process's umask set to :data:`UMASK` for the test, the old one restored after."""
    previous = os.umask(UMASK)
    try:
        yield UMASK
    finally:
        os.umask(previous)


def wrong_modes(folder: Path, mask: int) -> dict[str, str]:
    """Every path under ``folder`` whose mode is not what open()/mkdir() give under ``mask``."""
    wrong = {}
    for path in [folder, *folder.rglob("*")]:
        mode = path.lstat().st_mode
        want = 0o777 & ~mask if stat.S_ISDIR(mode) else 0o666 & ~mask
        if stat.S_IMODE(mode) != want:
            wrong[str(path.relative_to(folder))] = oct(stat.S_IMODE(mode))
    return wrong


def test_every_file_of_a_round_and_its_export_has_the_umasks_mode(tiny_sd3, tmp_path, umask):
    from jagg_pipeline.backbones import load_backbone
    from jagg_pipeline.stages.policy import export_policy
    from jagg_pipeline.stages.rollout import run_rollout
    from jagg_pipeline.stages.scoring import run_score
    from jagg_pipeline.stages.train import train_round

    config = make_config(tiny_sd3, backbone={"training": "lora", "lora": {"rank": 2}})
    out = tmp_path / "outputs"
    run_rollout(config, "base", "toy:train", out / "rollout", progress=False)
    run_score(config, out / "rollout", out / "scores")
    checkpoint = train_round(
        config, "base", out / "rollout", out / "scores", out / "ckpt", progress=False
    ).checkpoint
    export_policy(config, checkpoint, out / "export")
    load_backbone(config.backbone).save_lora(out / "adapter")

    written = {p.relative_to(out).as_posix() for p in out.rglob("*.safetensors")}
    assert {"ckpt/trainer/rng.safetensors", "adapter/adapter_model.safetensors"} <= written
    assert any(name.startswith("rollout/shard-") for name in written)
    assert any(name.startswith("export/") for name in written)
    assert wrong_modes(out, umask) == {}


def test_a_folder_written_whole_gets_the_umasks_modes(tmp_path, umask):
    """What save_pretrained and the toy world's build write inside an atomic folder."""
    import torch
    from safetensors.torch import save_file

    from jagg_pipeline.io.artifacts import atomic_directory

    with atomic_directory(tmp_path / "folder") as staging:
        (staging / "nested").mkdir(mode=0o700)
        save_file({"x": torch.zeros(2)}, staging / "nested" / "samples.safetensors")
    assert wrong_modes(tmp_path / "folder", umask) == {}
