"""One validator for the whole config file: ``config check``, and commands that read config.yaml.

``config check`` validates the base sections and the workflow section together and reports
every error at once, one line each naming the file and the dotted key; the stage commands and
``config show`` read the workflow's config.yaml as its base experiment.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jagg_pipeline.cli import main
from jagg_pipeline.config.fields import from_dict, to_dict
from jagg_pipeline.config.run import RunConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config.yaml"


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


def test_the_projects_config_passes_the_check(capsys):
    assert main(["config", "check", "--config", str(CONFIG)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{CONFIG}: OK"), out
    experiments = yaml.safe_load(CONFIG.read_text())["workflow"]["experiments"]
    for name in experiments:
        assert f"  {name}" in out, out
    assert "  compare_modes: 9 run(s) = 3 variant(s) x 3 seed(s)" in out, out


def test_config_show_of_the_workflow_config_prints_its_base_experiment(capsys):
    assert main(["config", "show", "--config", str(CONFIG)]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    data = yaml.safe_load(CONFIG.read_text())
    del data["workflow"]
    assert "workflow" not in shown
    assert shown == to_dict(from_dict(RunConfig, data))
    assert main(["config", "show", "--config", str(CONFIG), "--set", "train.rounds=3"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["rounds"] == 3


THREE_ERRORS = """\
sampler: {group_size: eight}
workflow:
  resultz: elsewhere
  experiments:
    modes:
      variants:
        exact: {jagg: {mode: exact}}
        fast: {jagg: {mode: fast}}
"""


def test_three_errors_in_different_places_are_reported_in_one_run(tmp_path, capsys):
    path = tmp_path / "three.yaml"
    path.write_text(THREE_ERRORS)
    assert main(["config", "check", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    errors = _errors(err)
    assert len(errors) == 3, err
    expected = {
        "sampler.group_size": "'eight' is not of type 'integer'",
        "workflow.resultz": "unknown key",
        "workflow.experiments.modes.variants.fast.jagg.mode": "'fast' is not one of",
    }
    for (key, says), line in zip(expected.items(), errors, strict=True):
        assert line.startswith(f"error: {path}: {key}: "), line
        assert says in line, line
    assert f"{path}: 3 error(s)" in err


def test_every_failing_variant_is_named_by_the_checks_across_fields(tmp_path, capsys):
    """The runs' __post_init__ checks: each failing variant, not only the first."""
    path = tmp_path / "windows.yaml"
    path.write_text(
        "jagg: {window: 4}\n"
        "workflow:\n"
        "  experiments:\n"
        "    windows:\n"
        "      variants: {small: {}, w20: {jagg: {window: 20}}, w30: {jagg: {window: 30}}}\n"
        "    sweep:\n"
        "      variants: {a: {}, b: {jagg: {mode: exact}}}\n"
        "      sweep: {key: jagg.window, values: [2, 40]}\n"
        "    empty:\n"
        "      seeds: []\n"
    )
    assert main(["config", "check", "--config", str(path)]) == 1
    errors = _errors(capsys.readouterr().err)
    where = f"error: {path}: workflow.experiments"
    assert [line.split(" (base + overrides)")[0] for line in errors[:3]] == [
        f"{where}.windows.variants.w20",
        f"{where}.windows.variants.w30",
        f"{where}.sweep.variants.a_window-40",
    ], errors
    assert "jagg.window: 30 is more than the 8 trained steps" in errors[1]
    assert errors[3] == f"{where}.empty.seeds: name at least one seed", errors
    assert len(errors) == 4, errors


def test_a_base_section_error_across_fields_is_reported(tmp_path, capsys):
    path = tmp_path / "base.yaml"
    path.write_text("jagg: {window: 20}\nworkflow: {experiments: {e: {}}}\n")
    assert main(["config", "check", "--config", str(path)]) == 1
    (line,) = _errors(capsys.readouterr().err)
    assert line.startswith(f"error: {path}: jagg.window: 20 is more than"), line


def test_every_duplicate_key_is_named_first(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text(
        "train: {lr: 0.1}\n"
        "jagg: {mode: exact, mode: jagg}\n"
        "train: {rounds: 2}\n"
        "grpo: {clip_range: 0}\n"
    )
    assert main(["config", "check", "--config", str(path)]) == 1
    errors = _errors(capsys.readouterr().err)
    assert errors[0] == (
        f"error: {path}: jagg.mode: duplicate key (lines 2 and 2): the last one would silently win"
    )
    assert errors[1].startswith(f"error: {path}: train: duplicate key (lines 1 and 3)")
    # The rest of the file is still checked (the last value of a key given twice).
    assert errors[2].startswith(f"error: {path}: grpo.clip_range: "), errors
    assert len(errors) == 3, errors


def test_check_applies_set_overrides_and_accepts_an_experiment_config(tmp_path, capsys):
    path = tmp_path / "experiment.yaml"
    path.write_text("train: {rounds: 2}\n")
    assert main(["config", "check", "--config", str(path)]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["config", "check", "--config", str(path), "--set", "train.rounds=x"]) == 1
    (line,) = _errors(capsys.readouterr().err)
    assert "(with --set train.rounds=x): train.rounds: 'x' is not of type 'integer'" in line


def test_stage_commands_read_the_workflow_config_as_its_base(tmp_path, capsys):
    from jagg_pipeline.cli.common import load_stage_config

    config = load_stage_config(CONFIG, ["train.rounds=3"])
    data = yaml.safe_load(CONFIG.read_text())
    assert config.train.rounds == 3
    assert config.jagg == from_dict(RunConfig, {"jagg": data["jagg"]}).jagg
    # The workflow section is still checked.
    path = tmp_path / "bad-workflow.yaml"
    path.write_text("train: {rounds: 2}\nworkflow: {resultz: x}\n")
    with pytest.raises(SystemExit, match=r"bad-workflow\.yaml: workflow\.resultz: unknown key"):
        load_stage_config(path, [])
    # A stage run on config.yaml gets past the config (to its missing input).
    with pytest.raises(SystemExit) as caught:
        main(
            [
                *("score", "--config", str(CONFIG)),
                *("--rollouts", str(tmp_path / "missing"), "--out", str(tmp_path / "out")),
            ]
        )
    message = str(caught.value)
    assert "missing" in message and "unknown key" not in message, message


@pytest.mark.parametrize("command", ["rollout", "score", "train", "evaluate"])
def test_stage_help_says_the_workflow_config_is_accepted(command, capsys):
    with pytest.raises(SystemExit) as caught:
        main([command, "--help"])
    assert caught.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--config FILE" in out
    assert "or the workflow's config.yaml (its base sections are used)" in out
