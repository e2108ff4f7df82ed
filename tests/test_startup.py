"""Start-up of the commands: the collector of a command process, what each stage job imports,
and the import / load / work seconds it records.

The job test runs rollout, score, train and evaluate as ``python -m jagg_pipeline`` processes
on a quickly built toy world and reads back which libraries each imported and its metrics lines.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from jagg_pipeline.reports.summary import RunMetrics, stage_seconds, stage_table
from jagg_pipeline.reports.tracker import TrackedRun
from jagg_pipeline.reports.tracking import metric_points, run_metrics
from jagg_pipeline.support import startup
from jagg_pipeline.support.startup import StageClock

# Runs ``python -m jagg_pipeline ARGS`` as ``-m`` does, then writes the top-level packages it
# imported to $MODULES_OUT (the exit status is kept).
RUN_AND_LIST = """
import json, os, runpy, sys
sys.argv = ["jagg_pipeline", *sys.argv[1:]]
try:
    runpy.run_module("jagg_pipeline", run_name="__main__", alter_sys=True)
finally:
    with open(os.environ["MODULES_OUT"], "w") as handle:
        json.dump(sorted({name.split(".")[0] for name in sys.modules}), handle)
"""


def _python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return result.stdout


def test_process_seconds_counts_from_the_process_start():
    start = time.perf_counter()
    age = float(
        _python(
            "import time; time.sleep(0.3)\n"
            "from jagg_pipeline.support.startup import process_seconds; print(process_seconds())"
        )
    )
    # The kernel counts in 10 ms ticks: allow two.
    assert 0.3 <= age <= time.perf_counter() - start + 0.02


def test_only_the_first_stage_of_a_command_process_records_import():
    first, second = json.loads(
        _python(
            "import json\n"
            "from jagg_pipeline.support import startup\n"
            "startup.start_command()\n"
            "a, b = startup.StageClock.start(), startup.StageClock.start()\n"
            "print(json.dumps([a.record(), b.record()]))"
        )
    )
    assert set(first) == {"import", "load", "work"} and first["import"] > 0
    assert set(second) == {"load", "work"}


def test_a_command_collects_less_often_and_exits_without_collecting():
    # What the collector looks like at exit (atexit runs after the command returned).
    code = (
        "import atexit, gc, runpy, sys\n"
        "atexit.register(lambda: print(gc.get_threshold(), gc.get_freeze_count() > 0))\n"
        "sys.argv = ['jagg_pipeline', 'config', 'show']\n"
        "runpy.run_module('jagg_pipeline', run_name='__main__', alter_sys=True)"
    )
    assert _python(code).splitlines()[-1] == f"{startup.COMMAND_GC_THRESHOLDS} True"


def test_a_stage_command_collects_nothing_until_its_stage_starts():
    # The collector is off through the imports; the stage's start freezes them and turns it on.
    code = (
        "import gc, json\n"
        "from jagg_pipeline.support import startup\n"
        "states = []\n"
        "for argv in (['config', 'show'], ['--x', 'rollout', '--config', 'c.yaml']):\n"
        "    gc.enable(); gc.unfreeze(); startup._import_claimed = False\n"
        "    startup.start_command(argv)\n"
        "    off = gc.isenabled()\n"
        "    startup.StageClock.start()\n"
        "    states.append([off, gc.isenabled(), gc.get_freeze_count() > 0])\n"
        "print(json.dumps(states))"
    )
    other, stage = json.loads(_python(code).splitlines()[-1])
    assert other == [True, True, False]
    assert stage == [False, True, True]


def test_an_import_block_freezes_its_modules_but_not_the_garbage_before_it(monkeypatch):
    # Outside a command process it changes nothing.
    frozen = gc.get_freeze_count()
    with startup.importing():
        assert gc.isenabled()
    assert gc.get_freeze_count() == frozen
    code = (
        "import gc, json, weakref\n"
        "from jagg_pipeline.support import startup\n"
        "startup.start_command(['train'])\n"
        "startup.StageClock.start()\n"
        "class Node: pass\n"
        "node = Node(); node.self = node; alive = weakref.ref(node); del node\n"
        "frozen = gc.get_freeze_count()\n"
        "with startup.importing():\n"
        "    inside = gc.isenabled()\n"
        "    import json.tool\n"
        "print(json.dumps([inside, gc.isenabled(), gc.get_freeze_count() > frozen, "
        "alive() is None]))"
    )
    assert json.loads(_python(code).splitlines()[-1]) == [False, True, True, True]


def test_a_stage_inside_another_program_records_load_and_work_only(monkeypatch):
    monkeypatch.setattr(startup, "_main_started", None)
    clock = StageClock.start()
    time.sleep(0.02)
    clock.lap("load")
    time.sleep(0.01)
    clock.lap("work")
    time.sleep(0.01)
    clock.lap("work")
    record = clock.record()
    assert set(record) == {"load", "work"}
    assert 0.02 <= record["load"] < record["load"] + record["work"]
    assert record["work"] >= 0.02


def _lines() -> list[dict]:
    """One round of each stage: two optimizer steps, the first with the job's seconds."""
    job = {"time.import": 2.0, "time.load": 6.0}
    return [
        {"stage": "rollout", "round": 0, "step": 0, "seconds": 1.5} | job | {"time.work": 1.0},
        {"stage": "score", "round": 0, "step": 0, "total_mean": 0.3, "time.import": 1.5}
        | {"time.load": 0.5, "time.work": 0.5},
        {"stage": "train", "round": 0, "step": 0, "time.forward": 0.5} | job | {"time.work": 2.0},
        {"stage": "train", "round": 0, "step": 1, "time.forward": 0.5},
        {"stage": "evaluate", "round": 0, "step": 0, "toy": 0.1, "toy_std": 0.0}
        | job
        | {"time.work": 0.5},
    ]


def test_the_summary_sets_work_against_overhead_per_stage():
    runs = [RunMetrics("exact", 0, lines=_lines()), RunMetrics("jagg", 0, lines=_lines())]
    stages = stage_seconds(runs)
    assert list(stages) == ["rollout", "score", "train", "evaluate"]
    assert stages["train"] == {"jobs": 2, "import": 2.0, "load": 6.0, "work": 2.0}
    text = stage_table(stages)
    assert "| rollout | 2 | 2.00 | 6.00 | 1.00 | 89% |" in text
    assert "| train | 2 | 2.00 | 6.00 | 2.00 | 80% |" in text
    # In-process stages (tests, notebooks) measure no start-up: no share to claim.
    unmeasured = [{k: v for k, v in line.items() if k != "time.import"} for line in _lines()]
    assert "| score | 1 | - | 0.50 | 0.50 | - |" in stage_table(
        stage_seconds([RunMetrics("exact", 0, lines=unmeasured)])
    )
    # Runs from before the stages recorded their seconds: no table.
    assert stage_table(stage_seconds([RunMetrics("exact", 0, lines=[])])) == ""


def test_tracking_reads_the_seconds_back_as_the_files_give_them_not_as_metrics():
    run = RunMetrics("exact", 0, lines=_lines())
    tracked = run_metrics(TrackedRun("exact", 0, {}, metric_points(run)))
    assert stage_seconds([tracked]) == stage_seconds([run])
    assert tracked.evaluations == {0: {"toy": 0.1}}


@pytest.fixture(scope="module")
def quick_world(tmp_path_factory):
    from jagg_pipeline.toyworld.build import build_toyworld
    from jagg_pipeline.toyworld.config import BuildConfig, PretrainConfig, ToyClipConfig

    out = tmp_path_factory.mktemp("toyworld")
    settings = BuildConfig(
        pretrain=PretrainConfig(steps=2, batch=4, warmup=1),
        clip=ToyClipConfig(steps=2, batch=8),
        eval_steps=2,
        eval_per_caption=1,
    )
    build_toyworld(out, settings, progress=False)
    return out


def _job(tmp_path, *argv: str) -> tuple[set[str], float]:
    """Run one command as a job; the top-level packages it imported and its wall seconds."""
    modules = tmp_path / f"{argv[0]}-modules.json"
    env = os.environ | {"MODULES_OUT": str(modules), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    return set(json.loads(modules.read_text())), wall


@pytest.mark.slow
def test_toy_world_jobs_import_what_they_use_and_record_their_seconds(quick_world, tmp_path):
    from jagg_pipeline.toyworld.config import experiment_sections

    data = experiment_sections(quick_world) | {
        "sampler": {"prompts_per_round": 2, "group_size": 2, "batch_size": 4},
        "eval": {"max_prompts": 2, "samples_per_prompt": 1, "num_steps": 2},
    }
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(data))
    base = ["--config", str(config)]
    rollout, scores, checkpoint, evaluation = (tmp_path / n for n in ("r", "s", "c", "e"))
    jobs = {
        "rollout": _job(tmp_path, "rollout", *base, "--policy", "base", "--out", str(rollout)),
        "score": _job(tmp_path, "score", *base, "--rollouts", str(rollout), "--out", str(scores)),
        "train": _job(
            tmp_path,
            "train",
            *base,
            *("--policy", "base", "--rollouts", str(rollout), "--scores", str(scores)),
            *("--out", str(checkpoint)),
        ),
        "evaluate": _job(tmp_path, "evaluate", *base, "--policy", "base", "--out", str(evaluation)),
    }
    imported = {stage: modules for stage, (modules, _) in jobs.items()}
    # The toy rewards (toy_attributes; toy_clipscore, a transformers CLIP) need no open_clip.
    assert all("open_clip" not in modules for modules in imported.values())
    # Scoring toy_attributes needs torch alone: no model library.
    assert not {"diffusers", "transformers", "peft"} & imported["score"]
    # The score table is read without pandas (pyarrow's dataset reader imports it).
    assert "pandas" not in imported["train"] and "pandas" not in imported["rollout"]
    folders = {"rollout": rollout, "score": scores, "train": checkpoint, "evaluate": evaluation}
    for stage, folder in folders.items():
        line = json.loads((folder / "metrics.jsonl").read_text().splitlines()[0])
        seconds = [line[f"time.{part}"] for part in startup.PARTS]
        assert all(s > 0 for s in seconds), (stage, line)
        assert sum(seconds) < jobs[stage][1], (stage, line)
