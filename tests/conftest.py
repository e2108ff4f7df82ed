"""Test-wide settings: no hub access, one torch thread unless JAGG_TEST_THREADS says otherwise.

Tiny models on a shared 2-core machine run fastest on one thread; the suite is also run with
``JAGG_TEST_THREADS=2`` to show that no assertion depends on the float rounding of one setting.
The shared fixtures: those defined here, and the training helpers' (``pytest_plugins``).
Under pytest-xdist (``make test`` runs a worker per core and one more) the expensive session
fixtures are built once for all workers (``built_once``), not once per worker.
"""

import os
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

torch.set_num_threads(int(os.environ.get("JAGG_TEST_THREADS", "1")))

# The training tests' fixtures (tiny_sd3, base_rollout) live with their helpers.
pytest_plugins = ["train_helpers"]


# The groups that take minutes, longest first (results/ci-junit.xml of a CI run): started
# first, they do not end the run with one worker busy and the others idle (xdist keeps this
# order only under --no-loadscope-reorder, which `make test` passes; by default it starts the
# groups with the most tests first). The SLURM group's image test, its last, comes some ten
# minutes in, after CI's background image build.
LONGEST_FIRST = (
    "slurm",
    "toy-world",
    "test_world_size",
    "test_retention_losses",
    "test_workflow",
    "test_retention",
    "test_block",
    "test_hostile_config",
    "test_tracking",
    "test_sharded_policy",
    "test_distributed",
)


def _group(item: pytest.Item, toy_world_files: set[Path]) -> str:
    if "images" in item.fixturenames:
        return "images"
    # One worker builds the default toy world (minutes) for every file that uses it.
    return "toy-world" if item.path in toy_world_files else item.path.stem


# tryfirst: xdist's own hook reads the xdist_group marks added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """GPU tests (marker ``gpu``) are collected everywhere and skipped without CUDA.

    Under xdist (``--dist loadgroup``) each test file runs on one worker, so a module's fixtures
    are built once; files that share a service or an expensive session fixture (an
    ``xdist_group`` of their own, e.g. the one SLURM, the default toy world) run on the same
    worker. The longest groups start first; the tests that use the images run last.
    """
    toy_world_files = {item.path for item in items if "toy_world" in item.fixturenames}
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item, toy_world_files)))

    def order(item: pytest.Item) -> tuple[bool, int]:
        group = item.get_closest_marker("xdist_group").args[0]
        rank = LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)
        # Last, the tests that run in the images: CI builds them beside the tests, and a worker
        # that asked for them early would wait minutes, idle, for that build.
        return "images" in item.fixturenames, rank

    items.sort(key=order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (the GPU suite: pytest -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """Stop a run whose tests lost their group: it would still pass, with each file's module
    fixtures built once per worker (minutes each) and services shared by accident."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    lost = [nodeid for nodeid in ids if "@" not in nodeid]
    if lost:
        pytest.exit(
            f"--dist loadgroup: {len(lost)} tests carry no xdist group in their node id "
            f"(e.g. {lost[0]}); this pytest and pytest-xdist do not combine (pyproject.toml's "
            "pytest bound says why)",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def built_once(tmp_path_factory, name: str, build: Callable[[Path], Any]) -> Any:
    """``build(folder)`` run once per test session, its result shared by every xdist worker.

    Without xdist it builds into a fresh temporary folder. Under xdist the first worker to take
    the lock builds into its own folder and, on success, pickles the result beside the workers'
    folders; the others wait on the lock and read it (after a failure the next one tries anew).
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent
    result_file = root / f"{name}.pickle"
    with FileLock(str(root / f"{name}.lock")):
        if result_file.exists():
            return pickle.loads(result_file.read_bytes())
        result = build(tmp_path_factory.mktemp(name))
        result_file.write_bytes(pickle.dumps(result))
        return result


@pytest.fixture
def float64():
    """Run a test with float64 as the default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def saved_figures(monkeypatch):
    """Every matplotlib figure saved while the test runs, in order (still open to read back)."""
    from matplotlib.figure import Figure

    figures: list[Figure] = []
    original = Figure.savefig

    def record(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return figures


# The toy world that integration tests share: the default build (about 5 minutes on two
# cores), so that what the tests show about GRPO on it holds for the default experiment.
@pytest.fixture(scope="session")
def toy_world(tmp_path_factory):
    """(directory, report) of the default toy world, built once per test session."""
    from jagg_pipeline.toyworld.build import build_toyworld
    from jagg_pipeline.toyworld.config import BuildConfig

    def build(out: Path):
        return out, build_toyworld(out, BuildConfig(), progress=False)

    return built_once(tmp_path_factory, "toy-world", build)


def toy_experiment(world, **sections):
    """The default experiment pointed at a built toy world; ``sections`` update it."""
    from jagg_pipeline.toyworld.config import experiment_sections

    out, _ = world
    data = experiment_sections(out)
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


@pytest.fixture(scope="session")
def reduced_all(tmp_path_factory):
    """A workdir where the reduced `all` and `comparison` (workflow_helpers.REDUCED, tracking off)
    ran locally on 2 cores, with mlflow made unimportable (``poisoned/`` on PYTHONPATH).

    Tests copy it (with its .snakemake metadata) before changing anything, or compare with it.
    """
    from workflow_helpers import REDUCED, snakemake, write_config

    def run(workdir: Path) -> Path:
        write_config(workdir, REDUCED)
        poison = workdir / "poisoned/mlflow/__init__.py"
        poison.parent.mkdir(parents=True, exist_ok=True)
        poison.write_text('raise ImportError("mlflow imported with tracking off (poisoned)")\n')
        env = {
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(poison.parent.parent), os.environ.get("PYTHONPATH")])
            )
        }
        result = snakemake(workdir, "--cores", "2", "all", "comparison", env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        return workdir

    return built_once(tmp_path_factory, "reduced-all", run)


CI = os.environ.get("CI", "").lower() == "true"
ROOT = Path(__file__).resolve().parents[1]


def images_missing() -> str | None:
    """Why containers/build.sh cannot build the images here, or None when it can: its Debian
    base needs root and debootstrap, and without an apptainer on PATH, bubblewrap."""
    if os.geteuid() != 0:
        return "the images' Debian base is made with debootstrap, as root"
    if shutil.which("debootstrap") is None:
        return "no debootstrap (apt-get install debootstrap)"
    if shutil.which("apptainer") is None and shutil.which("bwrap") is None:
        return "no apptainer, and no bubblewrap to run Debian sid's (apt-get install bubblewrap)"
    return None


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """The sandbox images of containers/build.sh --sandbox ({"pipeline": folder, "summary":
    folder, "PATH": a PATH with its apptainer first}), built once per machine and cache
    (~/.cache/jagg-pipeline/images: minutes from scratch, nothing when the lock and
    containers/ are unchanged). Skips where they cannot be built, unless CI=true: then fails.
    """
    missing = images_missing()
    if missing:
        if CI:
            pytest.fail(f"CI=true and the images cannot be built: {missing}")
        pytest.skip(missing)

    def build(_: Path) -> dict[str, str]:
        # Lowest priority: the other worker's tests keep their core.
        result = subprocess.run(
            ["nice", "-n", "19", str(ROOT / "containers/build.sh"), "--sandbox"],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        print(result.stdout)
        folder = Path(result.stdout.split()[-1])
        cache = folder.parent
        path = os.pathsep.join([str(cache / "bin"), os.environ["PATH"]])
        return {name: str(folder / name) for name in ("pipeline", "summary")} | {"PATH": path}

    return built_once(tmp_path_factory, "images", build)
