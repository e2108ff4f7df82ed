"""The workflow inside its images: containers/*.def, built by containers/build.sh.

- what a job needs in an image (jagg_pipeline.workflow.containers): the checkout bound and
  first on the container's PYTHONPATH, whatever binds and paths the environment has;
- the package, run from a checkout that is not installed, reports the version it declares
  (so that manifests written in an image equal the venv's);
- `snakemake --sdm apptainer` runs the reduced `all` and `comparison` with each job in its
  rule's image (the sandboxes of `containers/build.sh --sandbox`), and every output equals
  the venv run's byte for byte (timings aside). Its SLURM twin is in test_slurm.py.

The images are built once per machine (conftest.py's ``images``, cached by the digest of the
locks and containers/); without root, debootstrap or bubblewrap the workflow test skips,
unless CI=true: then it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from workflow_helpers import (
    ROOT,
    comparable_outputs,
    containers_config,
    job_counts,
    snakemake,
    write_config,
)

from jagg_pipeline.workflow.containers import (
    APPTAINER_BIND,
    CONTAINER_PYTHONPATH,
    apptainer_environ,
    package_root,
)


def test_the_checkout_is_bound_and_first_on_the_containers_pythonpath(tmp_path):
    environ = apptainer_environ(tmp_path, {"PYTHONPATH": "/extra:/more"})
    assert environ[APPTAINER_BIND] == str(tmp_path)
    assert environ[CONTAINER_PYTHONPATH] == os.pathsep.join([str(tmp_path), "/extra", "/more"])


def test_binds_already_asked_for_stay_and_the_checkout_is_not_bound_twice(tmp_path):
    environ = apptainer_environ(
        tmp_path, {APPTAINER_BIND: f"/data:/data:ro,{tmp_path}", "PYTHONPATH": str(tmp_path)}
    )
    assert environ[APPTAINER_BIND] == f"/data:/data:ro,{tmp_path}"
    assert environ[CONTAINER_PYTHONPATH] == str(tmp_path)


def test_the_package_root_is_the_checkout_holding_the_package():
    assert package_root() == ROOT
    assert (package_root() / "jagg_pipeline/__init__.py").is_file()


def test_a_checkout_that_is_not_installed_reports_its_declared_version(tmp_path):
    import tomllib

    import jagg_pipeline

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    # -I: no site-packages (where the package is installed), the checkout alone on sys.path.
    script = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import jagg_pipeline as p; "
    script += "print(p.__version__, p.__file__)"
    result = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    version, where = result.stdout.split()
    assert version == declared == jagg_pipeline.__version__
    assert Path(where).is_relative_to(ROOT)


@pytest.mark.slow
@pytest.mark.timeout(5400)  # a first build on a new machine: about a quarter of an hour
def test_reduced_all_in_the_images_equals_the_venv_run(images, reduced_all, tmp_path):
    write_config(tmp_path, containers_config(images))
    started = time.monotonic()
    result = snakemake(
        tmp_path,
        "--cores",
        "2",
        "all",
        "comparison",
        # Last: --sdm takes every word after it.
        "--sdm",
        "apptainer",
        env={"PATH": images["PATH"]},
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    print(f"reduced `all` in the images: {time.monotonic() - started:.0f} s")
    # Every job that runs a command ran in its image (the targets run none).
    counts = job_counts(result.stderr)
    commands = sum(n for rule, n in counts.items() if rule not in ("total", "all", "comparison"))
    assert commands > 0 and result.stderr.count("Activating singularity image") == commands
    ours, venv = comparable_outputs(tmp_path), comparable_outputs(reduced_all)
    assert ours.keys() == venv.keys()
    assert [name for name in ours if ours[name] != venv[name]] == []
