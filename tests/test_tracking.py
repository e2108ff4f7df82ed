"""MLflow tracking and the comparison report, on the runs of the reduced `all` (reduced_all).

- `track` for two variants from two processes at once, against a real `mlflow server` on
  loopback and against the default local SQLite store: both runs read back complete (params,
  every metric point, artifacts) under one parent; a second `track` duplicates nothing;
- `compare` reads the runs back from MLflow into the same table as the files give, and its
  HTML's images load in headless Chromium (a screenshot is kept for the closing note);
- with `tracking.backend: none` the workflow ran (in reduced_all) with mlflow unimportable;
- faults, on synthetic runs (workflow_helpers.synthetic_run) against the same loopback
  server or a local store: an unreachable server fails `track` in < 30 s with one line naming
  it; a damaged or empty SQLite store fails `track` and `compare` naming the file (and is not
  started anew); a store that lost runs pushed to it is reported; a run whose files changed
  replaces its MLflow run, so that the comparison and the summary agree; in the workflow, a
  failed push is retried by the next run of `comparison`, and its comparison with it;
- more runs than one search returns (a page) are all read back.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from workflow_helpers import REDUCED, copy_run, snakemake, synthetic_run, write_config

from jagg_pipeline.reports.summary import RunMetrics, read_run
from jagg_pipeline.reports.tracker import PARENT_TAG
from jagg_pipeline.reports.tracking import flat_params, metric_points, run_key

VARIANTS = ("exact", "jagg")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 with its own temporary store; its URI."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    command = [str(Path(sys.executable).with_name("mlflow")), "server", "--workers", "1"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(root / "artifacts")]
    with open(root / "server.log", "w") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            assert server.poll() is None, (root / "server.log").read_text()[-2000:]
            time.sleep(0.5)
    else:
        pytest.fail(f"mlflow server not up in 120 s: {(root / 'server.log').read_text()[-2000:]}")
    yield uri
    os.killpg(server.pid, 15)
    server.wait(timeout=30)


def tracked_copy(reduced_all: Path, workdir: Path, uri: str) -> dict[str, Path]:
    """The reduced runs copied into ``workdir`` with tracking on (``uri``); variant -> folder."""
    runs = {}
    for variant in VARIANTS:
        folder = workdir / "results/all" / variant / "seed-0"
        shutil.copytree(reduced_all / "results/all" / variant / "seed-0", folder)
        config = yaml.safe_load((folder / "config.yaml").read_text())
        config["tracking"] = {"backend": "mlflow", "uri": uri, "mlflow_experiment": "jagg-test"}
        (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        runs[variant] = folder
    return runs


def cli(workdir: Path, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jagg_pipeline", *args],
        cwd=workdir,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def finish(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return out


def run_args(runs: dict[str, Path], variants=VARIANTS) -> list[str]:
    return [arg for v in variants for arg in ("--run", v, "0", str(runs[v]))]


def read_back(uri: str, name: str = "jagg-test") -> dict:
    """Every active run of experiment ``name``: run name -> (info, params, tags, points,
    artifacts)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(name)
    found = {}
    for run in client.search_runs([experiment.experiment_id], max_results=100):
        points = sorted(
            (key, m.value, m.step)
            for key in run.data.metrics
            for m in client.get_metric_history(run.info.run_id, key)
        )

        def artifacts(path=None, run_id=run.info.run_id):
            items = client.list_artifacts(run_id, path)
            return [x for i in items for x in (artifacts(i.path) if i.is_dir else [i.path])]

        found[run.info.run_name] = (run.info, run.data.params, run.data.tags, points, artifacts())
    return found


def test_only_measurements_become_metrics_not_the_structure_of_a_line():
    """A train line's window and probe structure (indices, step lists, intervals, sigmas) is
    flattened into keys like the measurements beside it; only the measurements are logged."""
    from jagg_pipeline.io.artifacts import metrics_record

    line = metrics_record(
        "train",
        0,
        0,
        {
            "loss": 0.5,
            "windows": [{"window": 0, "steps": [3, 4, 5], "backward_calls": 2}],
            "probe": [
                {
                    "index": 1,
                    "steps": [4, 5, 6],
                    "interval": [3, 4, 5, 6],
                    "sigma_start": 0.9,
                    "sigma_end": 0.7,
                    "jagg": {"cos_sim": 0.98, "rel_err": 0.2},
                }
            ],
        },
    )
    keys = {key for key, _, _ in metric_points(RunMetrics("jagg", 0, [line]))}
    assert keys == {
        "train/loss",
        "train/windows.0.backward_calls",
        "train/probe.0.jagg.cos_sim",
        "train/probe.0.jagg.rel_err",
    }


@pytest.mark.parametrize("store", ["server", "local"])
def test_track_two_variants_at_once_reads_back_complete_and_never_duplicates(
    store, reduced_all, tmp_path, request
):
    if store == "server":
        uri = request.getfixturevalue("mlflow_server")
    else:
        uri = f"sqlite:///{tmp_path / 'results/mlflow.db'}"
    runs = tracked_copy(reduced_all, tmp_path, uri)
    # Two processes at once, one variant each (a fresh store: both race to create it).
    first = [cli(tmp_path, "track", "--experiment", "all", *run_args(runs, [v])) for v in VARIANTS]
    for process in first:
        finish(process)
    tracked = read_back(uri)
    assert set(tracked) == {"all", "exact/seed-0", "jagg/seed-0"}  # one parent, two children
    parent = tracked["all"][0].run_id
    assert tracked["all"][2][PARENT_TAG] == "all"
    for variant in VARIANTS:
        info, params, tags, points, artifacts = tracked[f"{variant}/seed-0"]
        config = yaml.safe_load((runs[variant] / "config.yaml").read_text())
        assert tags["mlflow.parentRunId"] == parent
        assert tags["jagg_run_key"] == run_key(runs[variant], "all", variant, 0)
        assert json.loads(tags["jagg_overrides"]) == {
            "jagg": {"mode": variant, "probe_every": 1},
            "train": {"rounds": 2},
        }
        assert params == flat_params(config)
        expected = metric_points(read_run(runs[variant], variant, 0))
        assert points == sorted(expected)
        names = {k for k, _, _ in points}
        assert {"train/loss", "train/time.backward", "evaluate/toy_attributes"} <= names
        assert {"train/probe.0.jagg.cos_sim", "train/routing.routed.0"} <= names
        assert set(artifacts) >= {
            "config.yaml",
            "eval/trained-0000/grid.png",
            "eval/trained-0002/grid.png",
        }
        assert info.status == "FINISHED"

    # Again, both variants from one process: the same runs, not one point more.
    finish(cli(tmp_path, "track", "--experiment", "all", *run_args(runs)))
    again = read_back(uri)
    assert {name: r[0].run_id for name, r in again.items()} == {
        name: r[0].run_id for name, r in tracked.items()
    }
    assert {name: r[3] for name, r in again.items()} == {n: r[3] for n, r in tracked.items()}


def test_compare_reads_mlflow_back_and_its_html_images_load(reduced_all, tmp_path):
    uri = f"sqlite:///{tmp_path / 'results/mlflow.db'}"
    runs = tracked_copy(reduced_all, tmp_path, uri)
    finish(cli(tmp_path, "track", "--experiment", "all", *run_args(runs)))
    out = tmp_path / "report"
    printed = finish(
        cli(tmp_path, "compare", "--experiment", "all", *run_args(runs), "--out", str(out))
    )
    assert "runs from MLflow" in printed
    # The same comparison as the files give (the summary rule's table).
    table = (out / "table.md").read_text()
    assert table == (reduced_all / "results/all/summary/table.md").read_text()
    # One seed per variant: values alone, no "+- 0.000".
    assert "| exact | 1 |" in table and "+-" not in table, table
    images = ["curves.png", "speed.png", "cos_sim.png"]
    for name in images:
        assert (out / name).stat().st_size > 10_000
    page = (out / "index.html").read_text()
    assert "n=1" in page
    assert all(f'src="{name}"' in page for name in images)
    if CHROMIUM is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true and no chromium (apt install chromium)")
        pytest.skip("no chromium to open the report")
    # Load the page's images in Chromium and report each one's decoded width.
    probe = tmp_path / "probe.html"
    tags = "".join(f'<img src="{(out / name).as_uri()}">' for name in images)
    probe.write_text(
        f"<html><body>{tags}<pre id=w></pre><script>window.onload = () => "
        "{document.getElementById('w').textContent = JSON.stringify("
        "[...document.images].map(i => i.naturalWidth))}</script></body></html>"
    )
    chrome = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--allow-file-access-from-files",
    ]
    dom = subprocess.run(
        [*chrome, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    widths = json.loads(dom.split('<pre id="w">')[1].split("</pre>")[0])
    assert len(widths) == len(images) and all(w > 300 for w in widths), widths
    screenshot = tmp_path / "report.png"
    subprocess.run(
        [
            *chrome,
            "--window-size=1300,1500",
            f"--screenshot={screenshot}",
            (out / "index.html").as_uri(),
        ],
        capture_output=True,
        timeout=120,
    )
    assert screenshot.stat().st_size > 10_000
    keep = os.environ.get("JAGG_KEEP_SCREENSHOT")
    if keep:
        shutil.copyfile(screenshot, keep)


def test_tracking_off_runs_without_mlflow(reduced_all):
    """reduced_all ran `all` and `comparison` (track and compare included) with mlflow poisoned."""
    assert REDUCED["tracking"]["backend"] == "none"
    tracked = json.loads((reduced_all / "results/all/tracking/tracked.json").read_text())
    assert set(tracked) == {
        run_key(reduced_all / f"results/all/{v}/seed-0", "all", v, 0) for v in VARIANTS
    }
    assert set(tracked.values()) == {""}
    assert (
        "tracking.backend: none" in (reduced_all / "results/comparison/all/index.html").read_text()
    )
    poisoned = subprocess.run(
        [sys.executable, "-c", "import mlflow"],
        env={**os.environ, "PYTHONPATH": str(reduced_all / "poisoned")},
        capture_output=True,
        text=True,
    )
    assert poisoned.returncode != 0 and "poisoned" in poisoned.stderr


def test_heatmaps_show_each_run_for_its_own_approximation(reduced_all):
    """From the files (config.yaml) and from MLflow (the jagg_mode tag) alike."""
    from jagg_pipeline.reports.compare import cos_sims
    from jagg_pipeline.reports.tracker import TrackedRun
    from jagg_pipeline.reports.tracking import run_metrics

    runs = [read_run(reduced_all / f"results/all/{v}/seed-0", v, 0) for v in VARIANTS]
    assert [run.mode for run in runs] == ["exact", "jagg"]
    cells = cos_sims(runs)
    assert set(cells) == {"exact: cos-sim of jagg", "jagg: cos-sim of jagg"}
    assert {w for w, _ in cells["jagg: cos-sim of jagg"]} == {0, 1}
    points = [("train/probe.0.no_interp.cos_sim", 0.5, 0), ("train/probe.0.jagg.cos_sim", 0.9, 0)]
    tracked = TrackedRun("drop", 0, {"jagg_mode": "no_interp"}, points)
    assert cos_sims([run_metrics(tracked)]) == {"drop: cos-sim of no_interp": {(0, 0): 0.5}}


def synthetic_runs(root: Path, uri: str, experiment: str) -> dict[str, Path]:
    """Two synthetic runs (exact, jagg) tracked at ``uri`` in ``experiment``."""
    tracking = {"backend": "mlflow", "uri": uri, "mlflow_experiment": experiment}
    return {v: synthetic_run(root / v / "seed-0", v, tracking=tracking) for v in VARIANTS}


def failed_in_one_line(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1, (out + err)[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


@pytest.mark.parametrize("server", ["down", "silent"])
def test_an_unreachable_server_fails_track_within_30_s_in_one_line(server, tmp_path):
    """Down: nothing listens (connection refused). Silent: the port accepts connections and
    never answers (a hung server or a dropped route): MLflow's timeouts, the worst case."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        if server == "silent":
            silent.listen(16)  # the kernel completes handshakes; nobody reads
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        runs = synthetic_runs(tmp_path, uri, "jagg-down")
        start = time.monotonic()
        line = failed_in_one_line(cli(tmp_path, "track", "--experiment", "all", *run_args(runs)))
        seconds = time.monotonic() - start
    assert seconds < 30, seconds
    assert f"MLflow tracking server {uri} cannot be used" in line, line
    print(f"track with the server {server}: failed in {seconds:.1f} s: {line}")


def test_a_damaged_or_empty_store_fails_naming_the_file(tmp_path):
    database = tmp_path / "results/mlflow.db"
    runs = synthetic_runs(tmp_path, f"sqlite:///{database}", "jagg-local")
    finish(cli(tmp_path, "track", "--experiment", "all", *run_args(runs)))
    intact = database.read_bytes()
    database.write_bytes(intact[: len(intact) // 2])  # truncated
    start = time.monotonic()
    line = failed_in_one_line(cli(tmp_path, "track", "--experiment", "all", *run_args(runs)))
    assert time.monotonic() - start < 30
    assert f"{database}: the SQLite MLflow store" in line and "malformed" in line, line
    out = tmp_path / "report"
    compare = cli(tmp_path, "compare", "--experiment", "all", *run_args(runs), "--out", str(out))
    assert f"{database}: the SQLite MLflow store" in failed_in_one_line(compare)
    assert not out.exists()
    database.write_bytes(b"")  # emptied: not silently made a new store
    line = failed_in_one_line(cli(tmp_path, "track", "--experiment", "all", *run_args(runs)))
    assert f"{database}: empty (0 bytes), not an MLflow store" in line, line
    assert database.stat().st_size == 0


@pytest.mark.parametrize("store", ["server", "local"])
def test_a_store_that_lost_pushed_runs_is_reported_not_started_anew(store, tmp_path, request):
    from mlflow.tracking import MlflowClient

    database = tmp_path / "results/mlflow.db"
    uri = request.getfixturevalue("mlflow_server") if store == "server" else f"sqlite:///{database}"
    runs = synthetic_runs(tmp_path, uri, f"jagg-lost-{store}")
    out = tmp_path / "tracking/tracked.json"
    push = ("track", "--experiment", "all", *run_args(runs), "--out", str(out))
    finish(cli(tmp_path, *push))
    ledger = out.with_name("pushed.json")
    assert set(json.loads(ledger.read_text())[uri][f"jagg-lost-{store}"]) == set(
        json.loads(out.read_text())
    )
    if store == "server":  # the runs deleted behind the pipeline's back
        client = MlflowClient(tracking_uri=uri)
        for run_id in json.loads(out.read_text()).values():
            client.delete_run(run_id)
    else:  # the store deleted
        database.unlink()
    line = failed_in_one_line(cli(tmp_path, *push))
    assert "2 run(s) pushed there before are gone" in line and str(ledger) in line, line
    assert store == "server" or not database.exists()  # no new store
    ledger.unlink()  # the user's way to start over
    finish(cli(tmp_path, *push))
    assert set(read_back(uri, f"jagg-lost-{store}")) == {"all", "exact/seed-0", "jagg/seed-0"}


def test_more_runs_than_a_search_page_are_all_found(tmp_path, monkeypatch):
    """7 runs under one parent, searched 3 at a time: all are read back, none is missing."""
    from jagg_pipeline.reports import mlflow_store
    from jagg_pipeline.reports.tracker import RUN_KEY_TAG, RunRecord

    monkeypatch.setattr(mlflow_store, "SEARCH_PAGE", 3)
    tracker = mlflow_store.MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "jagg-pages")
    keys = [f"all/exact/seed-{seed}" for seed in range(7)]
    for seed, key in enumerate(keys):
        tags = {RUN_KEY_TAG: key, "jagg_variant": "exact", "jagg_seed": str(seed)}
        tracker.push(RunRecord(key, "all", key, {}, tags, [("train/loss", float(seed), 0)]))
    runs = tracker.runs("all")
    assert sorted((run.seed, run.metrics[0][1]) for run in runs) == [(s, s) for s in range(7)]
    assert tracker.missing(keys) == []


def test_a_rerun_whose_files_changed_replaces_its_mlflow_run(mlflow_server, tmp_path):
    runs = synthetic_runs(tmp_path, mlflow_server, "jagg-rerun")
    finish(cli(tmp_path, "track", "--experiment", "all", *run_args(runs)))
    first = read_back(mlflow_server, "jagg-rerun")
    # A rerun of jagg's training: other timings, so another update-stage figure.
    record = runs["jagg"] / "round-0001/metrics/train.jsonl"
    line = json.loads(record.read_text())
    line["time.forward"] += 0.5
    record.write_text(json.dumps(line) + "\n")
    again = cli(tmp_path, "track", "--experiment", "all", *run_args(runs))
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    assert "jagg/seed-0: its files changed since MLflow run" in err, err
    second = read_back(mlflow_server, "jagg-rerun")
    assert second["exact/seed-0"][0].run_id == first["exact/seed-0"][0].run_id
    assert second["jagg/seed-0"][0].run_id != first["jagg/seed-0"][0].run_id
    assert second["jagg/seed-0"][2]["jagg_replaces"] == first["jagg/seed-0"][0].run_id
    for variant in VARIANTS:
        expected = metric_points(read_run(runs[variant], variant, 0))
        assert second[f"{variant}/seed-0"][3] == sorted(expected), variant
    # The page read back from MLflow and the summary read from the files agree.
    finish(cli(tmp_path, "compare", "--experiment", "all", *run_args(runs), "--out", "report"))
    summary = ["summarize", "--title", "all", *run_args(runs), "--out", "summary"]
    finish(cli(tmp_path, *summary))
    page, files = (tmp_path / "report/table.md"), (tmp_path / "summary/table.md")
    assert page.read_text() == files.read_text()
    assert "| 1.85 (1.25 + 0.50 + 0.10) |" in page.read_text()  # the rerun's timings


def test_a_failed_push_is_retried_by_the_next_run(mlflow_server, reduced_all, tmp_path):
    """`comparison` with the server unreachable fails at `track` (one line in its log) and keeps
    nothing that passes for up to date: the next run pushes and compares again."""
    copy_run(reduced_all, tmp_path)
    config = json.loads(json.dumps(REDUCED))
    config["tracking"] = {"backend": "mlflow", "uri": mlflow_server, "mlflow_experiment": "jagg-wf"}
    write_config(tmp_path, config)
    down = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}  # not in the digests
    failed = snakemake(tmp_path, "--cores", "2", "comparison", env=down, timeout=600)
    assert failed.returncode != 0
    log = (tmp_path / "results/logs/all/track.log").read_text().strip().splitlines()
    assert len(log) == 1 and down["MLFLOW_TRACKING_URI"] in log[0], log
    assert not (tmp_path / "results/all/tracking/tracked.json").exists()
    plan = snakemake(tmp_path, "--cores", "2", "comparison", "--dry-run", "--quiet", "rules")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert {"track", "compare"} <= set(plan.stdout.split()), plan.stdout
    done = snakemake(tmp_path, "--cores", "2", "comparison", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "results/comparison/all/index.html").read_text()
    assert f"Runs read from MLflow ({mlflow_server}" in page
    assert set(read_back(mlflow_server, "jagg-wf")) == {"all", "exact/seed-0", "jagg/seed-0"}
