"""Corrupt inputs are refused naming the file, and nothing already written is touched.

Each fault is real: bytes cut or flipped in the files a stage wrote, a table edited by hand,
a text file among images, a checkpoint made under another config. Stage manifests record the
digest of every data file; every consumer verifies them before reading (manifest.check_input).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import (
    flip_byte,
    make_config,
    subprocess_env,
    write_config,
)

from jagg_pipeline.io.manifest import ManifestError, digest_path, manifest_path, read_manifest
from jagg_pipeline.io.tables import read_table, write_table
from jagg_pipeline.stages.rollout import run_rollout
from jagg_pipeline.stages.scoring import run_score, table_path
from jagg_pipeline.stages.train import train_round


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture
def round_copy(base_rollout, tmp_path) -> tuple[Path, Path]:
    """A private copy of the session's scored rollout (rollout, scores) to damage."""
    rollouts, scores = base_rollout
    shutil.copytree(rollouts, tmp_path / "rollout")
    shutil.copytree(scores, tmp_path / "scores")
    return tmp_path / "rollout", tmp_path / "scores"


@pytest.mark.parametrize("damage", [_cut, flip_byte], ids=["truncated", "flipped byte"])
def test_a_damaged_rollout_shard_is_refused_by_score_and_train(
    damage, tiny_sd3, round_copy, tmp_path
):
    config = make_config(tiny_sd3)
    rollouts, scores = round_copy
    before = digest_path(scores)
    shard = rollouts / "shard-0.safetensors"
    damage(shard)
    with pytest.raises(ManifestError, match=rf"^{shard}: corrupt or changed"):
        run_score(config, rollouts, scores)  # into the existing scores folder
    assert digest_path(scores) == before  # nothing overwritten
    with pytest.raises(ManifestError, match=rf"^{shard}: corrupt or changed"):
        train_round(config, "base", rollouts, scores, tmp_path / "ckpt", progress=False)
    assert not (tmp_path / "ckpt").exists()


def test_an_edited_score_table_is_refused(tiny_sd3, round_copy, tmp_path):
    config = make_config(tiny_sd3)
    rollouts, scores = round_copy
    table = table_path(scores)
    rows = read_table(table)
    rows[0]["advantage"] = float("nan")
    write_table(table, rows)
    with pytest.raises(ManifestError, match=rf"^{table}: corrupt or changed"):
        train_round(config, "base", rollouts, scores, tmp_path / "ckpt", progress=False)


def test_damaged_or_foreign_checkpoints_are_refused_when_sampling_from_them(
    tiny_sd3, round_copy, tmp_path
):
    config = make_config(tiny_sd3)
    rollouts, scores = round_copy
    checkpoint = train_round(
        config, "base", rollouts, scores, tmp_path / "ckpt", progress=False
    ).checkpoint
    out = tmp_path / "next"
    run_rollout(config, checkpoint, "toy:train", out, round_index=1, progress=False)
    before = digest_path(out)
    # Another config's checkpoint (a different backbone section): refused by its manifest.
    other = make_config(tiny_sd3, backbone={"height": 48, "width": 48})
    with pytest.raises(ManifestError, match=rf"^{checkpoint}: was made with a different config"):
        run_rollout(other, checkpoint, "toy:train", out, round_index=1, progress=False)
    # Cut weights: refused naming the weight file, before the rollout folder is touched.
    weights = next((checkpoint / "policy").glob("*.distcp"))
    _cut(weights)
    with pytest.raises(ManifestError, match=rf"^{weights}: corrupt or changed"):
        run_rollout(config, checkpoint, "toy:train", out, round_index=1, progress=False)
    assert digest_path(out) == before


def test_a_non_image_in_an_image_folder_is_refused_naming_it(tmp_path):
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    for name in ("a.png", "b.png"):
        Image.new("RGB", (16, 16), "red").save(images / name)
    (images / "c.png").write_text("not an image\n")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\nanother\nthird\n")
    out = tmp_path / "scores.csv"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jagg_pipeline",
            "score-images",
            "--images",
            str(images),
            "--prompts",
            str(prompts),
            "--reward",
            "jpeg_compressibility",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert result.returncode != 0
    assert f"{images / 'c.png'}: not a readable image" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not out.exists()


@pytest.mark.slow
def test_sigkill_during_a_rollout_then_a_rerun_gives_the_uninterrupted_rollout(tiny_sd3, tmp_path):
    """Killed while sampling (its folder begun, no manifest yet): the folder is never taken
    as finished, and the rerun writes exactly what an uninterrupted rollout writes."""
    config = make_config(tiny_sd3, sampler={"prompts_per_round": 8, "batch_size": 4})
    reference = tmp_path / "reference"
    run_rollout(config, "base", "toy:train", reference, progress=False)
    out = tmp_path / "rollout"
    args = ["--config", str(write_config(config, tmp_path / "config.yaml")), "--policy", "base"]
    command = [sys.executable, "-m", "jagg_pipeline", "rollout", *args, "--out", str(out)]
    process = subprocess.Popen(command, env=subprocess_env(), stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not out.is_dir() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)  # the folder appears once the model is loaded: sampling starts
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL, "the rollout finished before the kill"
    assert not manifest_path(out).exists()
    with pytest.raises(ManifestError, match="no manifest"):
        read_manifest(out)
    rerun = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert digest_path(out) == digest_path(reference)
    assert read_manifest(out)["files"] == read_manifest(reference)["files"]


@pytest.fixture
def small_filesystem(tmp_path):
    """Mount a tmpfs of ``size`` bytes (root only); yields the mounting function."""
    mounted = []

    def mount(size: int) -> Path | None:
        point = tmp_path / "small"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True,
        )
        if result.returncode != 0:
            return None
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_full_disk_gives_a_clear_error_and_keeps_the_previous_checkpoint(
    tiny_sd3, round_copy, tmp_path, small_filesystem, monkeypatch
):
    """A real ENOSPC on a tmpfs that holds one checkpoint but not a second beside it (the
    rewrite stages the new one before swapping); without root, the same failure injected at
    the write's fsync."""
    config = make_config(tiny_sd3)
    rollouts, scores = round_copy
    first = train_round(config, "base", rollouts, scores, tmp_path / "first", progress=False)
    size = sum(p.stat().st_size for p in first.checkpoint.rglob("*") if p.is_file())
    volume = small_filesystem(size * 3 // 2)
    if volume is None:  # not root: inject the error the kernel would give
        import os

        def full(fd):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "fsync", full)
        volume = tmp_path / "volume"
        volume.mkdir()
    target = volume / "ckpt"
    shutil.copytree(first.checkpoint, target)
    before = digest_path(target)
    args = ["--config", str(write_config(config, tmp_path / "config.yaml")), "--policy", "base"]
    args += ["--rollouts", str(rollouts), "--scores", str(scores), "--out", str(target)]
    from jagg_pipeline.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["train", *args])
    message = str(exited.value.code)
    assert message.startswith(f"error: {target}: no space left on the device"), message
    assert "is intact" in message
    assert digest_path(target) == before
    assert sorted(p.name for p in volume.iterdir()) == ["ckpt"]  # no staging left behind


def test_a_cuda_device_without_a_gpu_is_refused_in_words(tiny_sd3, tmp_path):
    import torch

    from jagg_pipeline.cli import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    config = make_config(tiny_sd3, backbone={"device": "cuda"})
    args = ["--config", str(write_config(config, tmp_path / "config.yaml")), "--policy", "base"]
    with pytest.raises(SystemExit) as exited:
        main(["rollout", *args, "--out", str(tmp_path / "rollout")])
    assert str(exited.value.code).startswith("error: backbone.device: cuda needs CUDA device 0")
    assert not (tmp_path / "rollout").exists()


@pytest.mark.slow
def test_sigkill_while_the_checkpoint_is_written_then_a_rerun_gives_the_same_checkpoint(
    tiny_sd3, round_copy, tmp_path
):
    """Killed once its staging folder exists (the round trained, the files being written):
    nothing stands under the final name, and the rerun clears the leftovers and writes the
    uninterrupted run's checkpoint byte for byte."""
    from train_helpers import assert_same_checkpoint

    from jagg_pipeline.io.artifacts import staging_path

    config = make_config(tiny_sd3)
    rollouts, scores = round_copy
    reference = train_round(config, "base", rollouts, scores, tmp_path / "ref", progress=False)
    out = tmp_path / "ckpt"
    staging = staging_path(out)
    args = ["--config", str(write_config(config, tmp_path / "config.yaml")), "--policy", "base"]
    args += ["--rollouts", str(rollouts), "--scores", str(scores), "--out", str(out)]
    command = [sys.executable, "-m", "jagg_pipeline", "train", *args]
    process = subprocess.Popen(command, env=subprocess_env(), stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not staging.exists() and time.monotonic() < deadline and process.poll() is None:
        pass  # spin: the staging folder lives for milliseconds
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL, "the checkpoint was written before the kill"
    assert staging.exists() and not out.exists()
    rerun = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert_same_checkpoint(out, reference.checkpoint)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
