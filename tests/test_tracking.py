"""MLflow tracking and the comparison report, on the runs of the reduced `all` (reduced_all).

- `track` for two variants from two processes at once, against a real `mlflow server` on
  loopback and against the default local SQLite store: both runs read back complete (params,
  every metric point, artifacts) under one parent; a second `track` duplicates nothing;
- `compare` reads the runs back from MLflow into the same table as the files give, and its
  HTML's images load in headless Chromium (a screenshot is kept for the closing note);
- with `tracking.backend: none` the workflow ran (in reduced_all) with mlflow unimportable.
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
from workflow_helpers import REDUCED

from jagg_pipeline.summary import read_run
from jagg_pipeline.tracking import PARENT_TAG, flat_params, metric_points, run_key

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
        config["tracking"] = {"backend": "mlflow", "uri": uri, "experiment": "jagg-test"}
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


def read_back(uri: str) -> dict:
    """Every run of the test experiment: name -> (info, params, tags, points, artifacts)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("jagg-test")
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
    first = [cli(tmp_path, "track", "--target", "all", *run_args(runs, [v])) for v in VARIANTS]
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
    finish(cli(tmp_path, "track", "--target", "all", *run_args(runs)))
    again = read_back(uri)
    assert {name: r[0].run_id for name, r in again.items()} == {
        name: r[0].run_id for name, r in tracked.items()
    }
    assert {name: r[3] for name, r in again.items()} == {n: r[3] for n, r in tracked.items()}


def test_compare_reads_mlflow_back_and_its_html_images_load(reduced_all, tmp_path):
    uri = f"sqlite:///{tmp_path / 'results/mlflow.db'}"
    runs = tracked_copy(reduced_all, tmp_path, uri)
    finish(cli(tmp_path, "track", "--target", "all", *run_args(runs)))
    out = tmp_path / "report"
    printed = finish(
        cli(tmp_path, "compare", "--target", "all", *run_args(runs), "--out", str(out))
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
    """reduced_all ran `all` and `report` (track and compare included) with mlflow poisoned."""
    assert REDUCED["tracking"]["backend"] == "none"
    tracked = json.loads((reduced_all / "results/all/tracking/tracked.json").read_text())
    assert set(tracked) == {
        run_key(reduced_all / f"results/all/{v}/seed-0", "all", v, 0) for v in VARIANTS
    }
    assert set(tracked.values()) == {""}
    assert "tracking.backend: none" in (reduced_all / "results/report/all/index.html").read_text()
    poisoned = subprocess.run(
        [sys.executable, "-c", "import mlflow"],
        env={**os.environ, "PYTHONPATH": str(reduced_all / "poisoned")},
        capture_output=True,
        text=True,
    )
    assert poisoned.returncode != 0 and "poisoned" in poisoned.stderr


def test_heatmaps_show_each_run_for_its_own_approximation(reduced_all):
    """From the files (config.yaml) and from MLflow (the jagg_mode tag) alike."""
    from jagg_pipeline.compare import cos_sims
    from jagg_pipeline.tracking import TrackedRun, run_metrics

    runs = [read_run(reduced_all / f"results/all/{v}/seed-0", v, 0) for v in VARIANTS]
    assert [run.mode for run in runs] == ["exact", "jagg"]
    cells = cos_sims(runs)
    assert set(cells) == {"exact: cos-sim of jagg", "jagg: cos-sim of jagg"}
    assert {w for w, _ in cells["jagg: cos-sim of jagg"]} == {0, 1}
    points = [("train/probe.0.no_interp.cos_sim", 0.5, 0), ("train/probe.0.jagg.cos_sim", 0.9, 0)]
    tracked = TrackedRun("drop", 0, {"jagg_mode": "no_interp"}, points)
    assert cos_sims([run_metrics(tracked)]) == {"drop: cos-sim of no_interp": {(0, 0): 0.5}}
