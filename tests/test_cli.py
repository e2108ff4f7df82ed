import json
import subprocess
import sys

import pytest

from jagg_pipeline.cli import build_parser, main


def test_gradcheck_help_explains_every_option():
    gradcheck = build_parser()._subparsers._group_actions[0].choices["gradcheck"]
    for action in gradcheck._actions:
        if action.dest != "help":
            assert action.help, f"--{action.dest} has no help text"
    text = gradcheck.format_help()
    for flag in ("--backbone", "--window", "--trajectory", "--dtype", "--jagg-frac", "--json"):
        assert flag in text


def test_gradcheck_writes_the_documented_json(tmp_path, capsys):
    out = tmp_path / "sub" / "report.json"
    args = ["gradcheck", "--backbone", "affine", "--trajectory", "chord", "--dtype", "float64"]
    assert main([*args, "--window", "4", "--json", str(out), "--max-rel-err", "1e-10"]) == 0
    printed = capsys.readouterr().out
    assert "jagg rel_err" in printed and "OK: worst window" in printed
    report = json.loads(out.read_text())
    # Windows of 4, 4, 1 steps: the sequential endpoint backward calls once per endpoint.
    assert report["backward_calls"] == {"exact": 9, "jagg": 5, "no_interp": 5}
    assert [w["index"] for w in report["windows"]] == [0, 1, 2]
    for w in report["windows"]:
        assert set(w) >= {"index", "sigma_start", "sigma_end", "jagg", "no_interp"}
        assert set(w["jagg"]) == {"cos_sim", "rel_err"}
        assert w["jagg"]["rel_err"] < 1e-10
        assert w["sigma_start"] >= w["sigma_end"]


def test_gradcheck_fails_the_threshold_off_the_chord(capsys):
    args = ["gradcheck", "--backbone", "mlp-dit", "--trajectory", "sde", "--dtype", "float32"]
    assert main([*args, "--window", "3", "--jagg-frac", "0.5", "--max-rel-err", "1e-10"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gradcheck", "--window", "1"], "must be >= 2"),
        (["gradcheck", "--jagg-frac", "1.5"], "must be in [0, 1]"),
        (["gradcheck", "--backbone", "unet"], "invalid choice"),
    ],
)
def test_gradcheck_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "jagg_pipeline", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "jagg_pipeline" in result.stdout
