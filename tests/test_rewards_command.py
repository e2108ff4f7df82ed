import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reward_models import tiny_models

from jagg_pipeline.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.getbasetemp())


def write_config(path, models, **rewards):
    """A run config whose rewards are the tiny local models; ``rewards`` replaces keys."""
    section = {
        "weights": "{hpsv21: 1.0, pickscore: 0.5}",
        "hpsv21": f"{{checkpoint: '{models.hps_checkpoint}', arch: '{models.hps_arch_json}'}}",
        "pickscore": f"{{model: '{models.hf_clip_dir}', processor: '{models.hf_clip_dir}'}}",
        "clipscore": f"{{model: '{models.hf_clip_dir}'}}",
        **rewards,
    }
    lines = ["rewards:", *(f"  {key}: {value}" for key, value in section.items())]
    path.write_text("\n".join([*lines, "eval:", "  metrics: [clipscore]", ""]))
    return path


def reward_lines(text):
    """The per-reward lines of the output, by reward name."""
    lines = [line for line in text.splitlines() if line and not line.startswith(("loading", "all"))]
    return {line.split()[0]: line for line in lines}


def test_help_imports_no_torch():
    code = (
        "import sys\n"
        "from jagg_pipeline.cli import main\n"
        "try:\n    main(['rewards', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--names" in result.stdout and "docs/reward-models.md" in result.stdout


def test_loads_every_reward_of_the_config_from_local_paths(models, tmp_path, capsys):
    from transformers import CLIPModel

    config = write_config(tmp_path / "exp.yaml", models)
    assert main(["rewards", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    lines = reward_lines(out)
    assert list(lines) == ["hpsv21", "pickscore", "clipscore"]  # weights, then eval.metrics
    assert "all 3 reward model(s) loaded" in out
    hps = lines["hpsv21"].split()
    assert hps[1:3] == ["cpu", "float32"] and int(hps[3].replace(",", "")) > 0
    assert f"checkpoint={models.hps_checkpoint.resolve()}" in lines["hpsv21"]
    assert f"arch={models.hps_arch_json.resolve()}" in lines["hpsv21"]
    clip_dir = models.hf_clip_dir.resolve()
    assert f"model={clip_dir}  processor={clip_dir}" in lines["pickscore"]
    # the printed count is the saved model's, counted independently
    parameters = sum(p.numel() for p in CLIPModel.from_pretrained(clip_dir).parameters())
    assert lines["clipscore"].split()[3] == f"{parameters:,}"


def test_names_dtype_and_hub_ids_from_the_cache(models, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    # A hub cache holding the tiny models as downloaded repos, as `hf download` leaves them.
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    for repo, files in [
        ("tiny-hps", [models.hps_checkpoint]),
        ("tiny-clip", sorted(models.hf_clip_dir.iterdir())),
    ]:
        snapshot = cache / f"models--jagg-test--{repo}" / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text(commit)
        for file in files:
            shutil.copy(file, snapshot)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    config = write_config(tmp_path / "exp.yaml", models)
    argv = [
        "rewards",
        "--config",
        str(config),
        "--names",
        "clipscore,hpsv21,jpeg_compressibility",
        "--set",
        "rewards.hpsv21.checkpoint=jagg-test/tiny-hps/HPS_v2.1_compressed.pt",
        "--set",
        "rewards.clipscore.model=jagg-test/tiny-clip",
        "--set",
        "rewards.clipscore.dtype=bfloat16",
    ]
    assert main(argv) == 0
    lines = reward_lines(capsys.readouterr().out)
    assert list(lines) == ["clipscore", "hpsv21", "jpeg_compressibility"]
    snapshots = cache.resolve()
    assert lines["clipscore"].split()[2] == "bfloat16"
    assert (
        f"model={snapshots}/models--jagg-test--tiny-clip/snapshots/{commit}" in lines["clipscore"]
    )
    assert (
        f"checkpoint={snapshots}/models--jagg-test--tiny-hps/snapshots/{commit}/"
        "HPS_v2.1_compressed.pt" in lines["hpsv21"]
    )
    assert lines["jpeg_compressibility"].split()[1:4] == ["cpu", "-", "0"]


def test_missing_files_are_each_reported_naming_key_and_path(models, tmp_path, capsys):
    missing = tmp_path / "nowhere" / "HPS_v2.1_compressed.pt"
    config = write_config(
        tmp_path / "exp.yaml",
        models,
        hpsv21=f"{{checkpoint: '{missing}', arch: '{models.hps_arch_json}'}}",
        pickscore=f"{{model: '{tmp_path / 'no-pickscore'}'}}",
    )
    start = time.monotonic()
    status = main(["rewards", "--config", str(config)])
    assert time.monotonic() - start < 15.0  # clipscore's load included; the failures are instant
    assert status == 1  # `python -m jagg_pipeline` exits with it
    captured = capsys.readouterr()
    # transformers' progress bars share stderr
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert errors[0].startswith(f"error: rewards.hpsv21.checkpoint: {missing} not found")
    assert errors[0].endswith("expected layout: docs/reward-models.md#hpsv21")
    assert errors[1].startswith(f"error: rewards.pickscore.model: {tmp_path / 'no-pickscore'} ")
    assert errors[1].endswith("docs/reward-models.md#pickscore")
    assert errors[2] == "error: 2 of 3 reward model(s) failed to load: hpsv21, pickscore"
    assert list(reward_lines(captured.out)) == ["clipscore"]  # the good one still loads


def test_workflow_config_is_accepted(models, tmp_path, capsys, monkeypatch):
    workflow_config = ROOT / "config.yaml"
    assert "workflow" in workflow_config.read_text()
    monkeypatch.chdir(tmp_path)  # so that the default results/toyworld/clip does not exist
    assert (
        main(["rewards", "--config", str(workflow_config), "--names", "jpeg_compressibility"]) == 0
    )
    assert list(reward_lines(capsys.readouterr().out)) == ["jpeg_compressibility"]
    # its own rewards: toy_attributes (weights) and toy_clipscore (eval.metrics)
    assert main(["rewards", "--config", str(workflow_config)]) == 1
    captured = capsys.readouterr()
    assert list(reward_lines(captured.out)) == ["toy_attributes"]
    assert "error: rewards.toy_clipscore.model: results/toyworld/clip not found" in captured.err
    toy_clip = f"rewards.toy_clipscore.model={models.hf_clip_dir}"
    assert main(["rewards", "--config", str(workflow_config), "--set", toy_clip]) == 0
    assert list(reward_lines(capsys.readouterr().out)) == ["toy_attributes", "toy_clipscore"]


def test_unusable_device_and_unknown_names_are_refused(models, tmp_path, capsys):
    config = write_config(tmp_path / "exp.yaml", models)
    with pytest.raises(SystemExit, match=r"^error: --device: cuda:99 needs CUDA device 99"):
        main(["rewards", "--config", str(config), "--device", "cuda:99"])
    with pytest.raises(SystemExit) as exit_info:
        main(["rewards", "--config", str(config), "--names", "hpsv21,pickscor"])
    assert exit_info.value.code == 2
    assert "pickscor: not a reward name; known rewards: hpsv21" in capsys.readouterr().err


def test_build_tiny_writes_models_the_printed_config_scores_with(tmp_path, capsys):
    import torch
    import yaml

    from jagg_pipeline.config.run import load_config
    from jagg_pipeline.rewards import load_reward
    from jagg_pipeline.rewards.tiny import COLOURS, MANIFEST, TINY_REWARDS, caption, colour_images

    target = tmp_path / "tiny"
    assert main(["rewards", "--build-tiny", str(target)]) == 0
    out = capsys.readouterr().out
    assert {path.name for path in target.iterdir()} == {MANIFEST, *TINY_REWARDS}
    assert not list(tmp_path.glob(".tiny.*"))  # the staging folder was renamed into place
    snippet = out[out.index("rewards:\n") :]
    assert yaml.safe_load(snippet) == yaml.safe_load((target / MANIFEST).read_text())
    pasted = tmp_path / "exp.yaml"
    pasted.write_text(snippet)
    config = load_config(pasted)
    assert list(config.rewards.weights) == ["hpsv21", "pickscore"]
    assert config.eval.metrics == ["hpsv21", "pickscore", "clipscore"]
    # Every model scores images of each colour highest with that colour's caption.
    names = list(COLOURS)
    images = colour_images(names, seed=123)
    for name in config.eval.metrics:
        reward = load_reward(name, config.rewards.spec(name), torch.device("cpu"))
        scores = torch.stack([reward(images, [caption(c)] * len(names)) for c in names], dim=1)
        assert (scores.argmax(dim=1) == torch.arange(len(names))).all(), (name, scores)
    # The manifest is a config the check accepts as it is.
    assert main(["rewards", "--config", str(target / MANIFEST)]) == 0
    assert list(reward_lines(capsys.readouterr().out)) == ["hpsv21", "pickscore", "clipscore"]


def test_build_tiny_refuses_a_foreign_folder_and_replaces_its_own(tmp_path, capsys, monkeypatch):
    from jagg_pipeline.rewards import tiny
    from jagg_pipeline.rewards.tiny import MANIFEST, TINY_REWARDS

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        main(["rewards", "--build-tiny", str(foreign)])
    assert exit_info.value.code != 0
    assert str(exit_info.value.code).startswith(f"error: --build-tiny {foreign}: ")
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert (foreign / "notes.txt").read_text() == "keep me"
    with pytest.raises(SystemExit, match="--build-tiny takes no --names"):
        main(["rewards", "--build-tiny", str(tmp_path / "new"), "--names", "hpsv21"])
    with pytest.raises(SystemExit, match="give --config FILE"):
        main(["rewards"])

    # An earlier build is replaced whole (the real builders are tested above; these are quick).
    monkeypatch.setattr(tiny, "build_tiny_reward", lambda name, folder: folder.mkdir())
    own = tmp_path / "own"
    assert main(["rewards", "--build-tiny", str(own)]) == 0
    (own / "hpsv21" / "stale").write_text("from the earlier build")
    assert main(["rewards", "--build-tiny", str(own)]) == 0
    assert {p.name for p in own.iterdir()} == {MANIFEST, *TINY_REWARDS}
    assert not (own / "hpsv21" / "stale").exists()
    capsys.readouterr()
