"""``export --out`` removes nothing it did not write, and says what it replaced.

One tiny SD3 checkpoint per training mode (LoRA, full), trained once for the module and kept
in a run folder's layout (``run/config.yaml``, ``run/round-0000/checkpoint``). Each refusal
is one ``export: --out PATH: <why>; <fix>`` line, and every file and folder under the test's
folders keeps its size and mtime (none added, none gone).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from stage_helpers import tiny_checkpoint, write_experiment

from jagg_pipeline.cli import main
from jagg_pipeline.io.artifacts import OutputError, atomic_directory
from jagg_pipeline.io.manifest import write_manifest
from jagg_pipeline.stages import policy as policies


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Configs and checkpoints by training mode, and a full export, under one folder."""
    root = tmp_path_factory.mktemp("export-world")
    base = tiny_checkpoint("sd3", root)
    world = {"root": root}
    for training in ("lora", "full"):
        run = root / f"run-{training}"
        run.mkdir()
        sections = {"backbone": {"training": training, "lora": {"rank": 2}}}
        config_file, config = write_experiment(run / "config.yaml", "sd3", base, **sections)
        trained = policies.load_policy(config, "base")
        for param in trained.trainable_parameters():
            param.data.add_(0.01)
        checkpoint = run / "round-0000" / "checkpoint"
        policies.save_policy(trained, checkpoint)
        write_manifest(checkpoint, stage="train", config=config)
        world[training] = (config_file, checkpoint)
    world["full export"] = root / "full-export"
    export(world, "full", world["full export"])
    return world


def export(world, training, out, cwd=None):
    """Run ``export`` of ``training``'s checkpoint to ``out``; the refusal line, if refused."""
    config_file, checkpoint = world[training]
    argv = ["export", "--config", str(config_file), "--policy", str(checkpoint), "--out"]
    try:
        main([*argv, str(out)])
    except SystemExit as refused:
        return str(refused.code)
    return None


def snapshot(*folders: Path) -> dict[str, tuple[bool, int, int]]:
    """Every path under ``folders`` (hidden ones too): is a folder, size, mtime in ns."""
    seen = {}
    for folder in folders:
        for path in [folder, *folder.rglob("*")]:
            stat = path.lstat()
            seen[str(path)] = (path.is_dir(), stat.st_size, stat.st_mtime_ns)
    return seen


def user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine\n")
    return path


def refused(world, training, out, why, tmp_path, shown=None):
    """Assert the export to ``out`` is refused with ``why``, touching nothing."""
    before = snapshot(world["root"], tmp_path)
    line = export(world, training, out)
    assert line is not None, f"{out}: not refused"
    assert line.startswith(f"export: --out {shown or out}: ") and "\n" not in line, line
    assert why in line and "; " in line.split(why, 1)[1], line
    assert snapshot(world["root"], tmp_path) == before, line


def test_a_folder_of_the_users_is_refused_untouched(world, tmp_path):
    mine = user_folder(tmp_path / "mine")
    refused(world, "lora", mine, "a non-empty folder that export did not write", tmp_path)
    assert (mine / "notes.txt").read_text() == "mine\n"


def test_the_checkpoint_and_the_folders_holding_it_are_refused(world, tmp_path):
    _, checkpoint = world["lora"]
    refused(world, "lora", checkpoint, "is the checkpoint being exported", tmp_path)
    holds = "holds the checkpoint being exported"
    refused(world, "lora", checkpoint.parent, holds, tmp_path)  # its round folder
    refused(world, "lora", checkpoint.parent.parent, holds, tmp_path)  # its run folder
    refused(world, "lora", checkpoint / "policy", "is inside the checkpoint", tmp_path)
    # Spelled with `..`: the resolved path is what counts.
    dotted = checkpoint / "policy" / ".."
    refused(world, "lora", dotted, "is the checkpoint being exported", tmp_path)


def test_other_runs_stage_outputs_and_workdirs_are_refused(world, tmp_path):
    _, full_checkpoint = world["full"]
    # Exporting the LoRA checkpoint over the full run's: a run, a round, a stage output.
    why = "is a run folder (it holds round-0000, config.yaml)"
    refused(world, "lora", full_checkpoint.parent.parent, why, tmp_path)
    refused(world, "lora", full_checkpoint.parent, "is a round folder of a run", tmp_path)
    refused(world, "lora", full_checkpoint, "is the output of stage 'train'", tmp_path)
    workdir = user_folder(tmp_path / "workdir")
    (workdir / ".snakemake").mkdir()
    refused(world, "lora", workdir, "is a Snakemake working folder", tmp_path)
    base = world["root"] / "tiny-sd3"
    refused(world, "lora", base, "is the base checkpoint (backbone.path)", tmp_path)


def test_the_current_folder_and_the_home_folder_are_refused(world, tmp_path, monkeypatch):
    here = user_folder(tmp_path / "here")
    monkeypatch.chdir(here)
    refused(world, "lora", ".", "is the current folder", tmp_path, shown=".")
    refused(world, "lora", "..", "is a folder holding the current folder", tmp_path, "..")
    home = user_folder(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    refused(world, "lora", home, "is the home folder", tmp_path)


def test_an_existing_file_is_refused_untouched(world, tmp_path):
    existing = tmp_path / "weights.safetensors"
    existing.write_bytes(b"not an export")
    refused(world, "lora", existing, "is an existing file", tmp_path)
    assert existing.read_bytes() == b"not an export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.safetensors"]


def test_an_export_of_the_other_kind_or_with_added_files_is_refused(world, tmp_path):
    full = world["full export"]
    refused(world, "lora", full, "holds an export of another kind (a diffusers pipeline,", tmp_path)
    changed = tmp_path / "changed"
    shutil.copytree(full, changed)
    (changed / "transformer" / "README.md").write_text("my notes\n")
    why = "is a previous export, but holds files it did not write (transformer/README.md)"
    refused(world, "full", changed, why, tmp_path)


def test_a_new_path_or_an_empty_folder_takes_the_export(world, tmp_path, capsys):
    _, checkpoint = world["lora"]
    fresh, empty = tmp_path / "new" / "adapter", tmp_path / "empty"
    empty.mkdir()
    for out in (fresh, empty):
        assert export(world, "lora", out) is None
        said = capsys.readouterr().out
        assert said == f"{checkpoint} exported to {out}\n"
        assert sorted(p.name for p in out.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "manifest.json",
            "pytorch_lora_weights.safetensors",
        ]
        manifest = json.loads((out / "manifest.json").read_text())
        assert (manifest["stage"], manifest["export"]) == ("export", "lora")
        assert manifest["inputs"]["policy"]["path"] == str(checkpoint / "policy")
    # The loaders users load adapters with read the folder as it is, manifest and all.
    from diffusers import DiffusionPipeline
    from peft import PeftModel

    base = str(world["root"] / "tiny-sd3")
    pipe = DiffusionPipeline.from_pretrained(base)
    pipe.load_lora_weights(str(fresh))
    transformer = DiffusionPipeline.from_pretrained(base).transformer
    PeftModel.from_pretrained(transformer, str(empty))  # injects into transformer in place
    for adapted in (pipe.transformer, transformer):
        assert any("lora_" in name for name, _ in adapted.named_parameters())


def test_a_previous_export_of_the_same_kind_is_replaced_and_said_so(world, tmp_path, capsys):
    """Replaced whole (nothing of the old one left beside it), through a symlink too; full too."""
    out = tmp_path / "adapter"
    assert export(world, "lora", out) is None
    capsys.readouterr()
    first = snapshot(out)
    assert export(world, "lora", out) is None
    assert capsys.readouterr().out.endswith(f"; replaced the previous export at {out.resolve()}\n")
    assert snapshot(out).keys() == first.keys() and snapshot(out) != first
    link = tmp_path / "link"
    link.symlink_to(out)
    assert export(world, "lora", link) is None
    assert capsys.readouterr().out.endswith(f"replaced the previous export at {out.resolve()}\n")
    assert link.is_symlink() and os.readlink(link) == str(out)
    full = tmp_path / "pipeline"
    shutil.copytree(world["full export"], full)
    assert export(world, "full", full) is None
    assert capsys.readouterr().out.endswith(f"replaced the previous export at {full.resolve()}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "link", "pipeline"]


def test_a_file_where_an_atomic_directory_goes_is_refused_as_it_is(tmp_path):
    """Not renamed to a hidden .NAME.old with a message saying it is intact."""
    target = tmp_path / "stage"
    target.write_text("a file\n")
    with pytest.raises(OutputError) as refusal, atomic_directory(target) as staging:
        (staging / "x").write_text("1")
    assert refusal.value.errno == errno.ENOTDIR
    assert refusal.value.strerror.startswith(f"{target}: is a file, where a folder is to be")
    assert target.read_text() == "a file\n"
    assert [p.name for p in tmp_path.iterdir()] == ["stage"]
