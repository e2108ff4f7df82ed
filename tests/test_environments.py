"""Per-rule environments and containers: every rule that runs a command names a conda env and a
container of one family that exist; every env, image and the Makefile install from the
committed locks through envs/install.sh and pin nothing themselves; the Dockerfiles pass
hadolint; and the summary family runs with its lock's packages alone.

Conda cannot be installed on the CI machines, so what can be checked without it is checked
here; the Apptainer images are built and run in tests/test_containers.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from fnmatch import fnmatch
from importlib.metadata import packages_distributions
from pathlib import Path

import yaml
from packaging.utils import canonicalize_name
from test_dependencies import pins
from workflow_helpers import ROOT

from jagg_pipeline.workflow.sections import ContainersConfig

RULE = re.compile(r"^rule (\w+):\n((?:[ \t]+.*\n|\n)*)", re.MULTILINE)
DIRECTIVE = r"^    {name}:\n\s+(.+)$"
FAMILIES = ("pipeline", "summary")
# Imports the summary family's environment does not have.
MODEL_LIBRARIES = ("torch", "torchvision", "diffusers", "transformers", "open_clip", "safetensors")
INSTALLER = "envs/install.sh"


def shell_rules() -> dict[str, tuple[Path, str]]:
    """Every rule of the workflow that runs a command: name -> (file, body)."""
    rules = {}
    for path in [ROOT / "Snakefile", *sorted((ROOT / "workflow/rules").glob("*.smk"))]:
        for match in RULE.finditer(path.read_text()):
            if re.search(r"^    (shell|script):", match.group(2), re.MULTILINE):
                rules[match.group(1)] = (path, match.group(2))
    return rules


def directive(body: str, name: str) -> str | None:
    match = re.search(DIRECTIVE.format(name=name), body, re.MULTILINE)
    return match.group(1).strip() if match else None


def test_every_rule_names_an_env_and_a_container_of_one_family_that_exist():
    rules = shell_rules()
    assert {"toyworld_clip", "rollout", "score", "train", "evaluate", "summary"} <= set(rules)
    for name, (path, body) in rules.items():
        conda = directive(body, "conda")
        container = directive(body, "container")
        assert conda and container, f"rule {name} ({path.name}) lacks conda: or container:"
        env = (path.parent / conda.strip("\"'")).resolve()
        assert env.is_file(), f"rule {name}: {env} does not exist"
        family = env.stem
        assert container == f"CONTAINERS.{family}", (name, container, family)
        image = Path(getattr(ContainersConfig(), family))
        assert (ROOT / image.with_suffix(".def")).is_file(), f"rule {name}: no recipe for {image}"
        assert (ROOT / "containers" / f"{family}.Dockerfile").is_file()
    assert {f.stem for f in (ROOT / "envs").glob("*.yaml")} == set(FAMILIES)


def family_locks() -> dict[str, list[str]]:
    """envs/install.sh's families: name -> the locks it installs, in order."""
    text = (ROOT / INSTALLER).read_text()
    return {
        family: locks.split()
        for family, locks in re.findall(
            r"^\s+([\w-]+)\)\s*(?:#.*\n\s*)?locks=\(([^)]*)\)", text, re.M
        )
    }


def test_install_sh_installs_each_family_from_committed_locks():
    locks = family_locks()
    assert set(locks) == {"pipeline", "pipeline-cpu", "summary"}
    assert locks["pipeline"] == ["requirements.lock", "requirements-hpsv2.lock"]
    for family in FAMILIES:
        for lock in locks[family]:
            assert (ROOT / lock).is_file(), f"{family}: {lock} is not committed (make lock)"
    text = (ROOT / INSTALLER).read_text()
    assert "--require-hashes --no-deps" in text


def test_every_env_and_image_and_the_makefile_install_through_install_sh():
    locks = family_locks()
    makefile = (ROOT / "Makefile").read_text()
    stamp = re.search(r"^\$\(STAMP\): (.*)\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert {"pyproject.toml", *locks["pipeline"], INSTALLER} <= set(stamp.group(1).split())
    assert f"{INSTALLER} pipeline --editable" in stamp.group(2)
    for family in FAMILIES:
        env = yaml.safe_load((ROOT / f"envs/{family}.yaml").read_text())
        assert "python=3.11" in env["dependencies"]
        # The yaml installs the package alone; its post-deploy script installs the lock.
        pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
        assert pip == ["--no-deps", "--editable .."], family
        deploy = (ROOT / f"envs/{family}.post-deploy.sh").read_text()
        assert f'/envs/install.sh" {family} --editable' in deploy, family

        dockerfile = (ROOT / f"containers/{family}.Dockerfile").read_text()
        copied = [
            source
            for line in re.findall(r"^COPY (.+)$", dockerfile, re.MULTILINE)
            for source in line.split()[:-1]
        ]
        run = re.findall(r"^RUN (.+)$", dockerfile, re.MULTILINE)
        argument = '"$FAMILY"' if family == "pipeline" else family
        venv = "python3 -m venv /opt/venv && PYTHON=/opt/venv/bin/python"
        assert run == [f"{venv} {INSTALLER} {argument}"]
        if family == "pipeline":
            assert "ARG FAMILY=pipeline\n" in dockerfile
        wanted = {
            *locks[family],
            INSTALLER,
            *(locks["pipeline-cpu"] if family == "pipeline" else []),
        }
        for path in wanted:
            assert any(fnmatch(path, source) for source in copied), f"{family}.Dockerfile: {path}"

        assert "ARG BASE=python:3.11-slim-bookworm\nFROM ${BASE}\n" in dockerfile, family
        # The Apptainer images hold the locks alone: the workflow binds the package's checkout.
        definition = (ROOT / f"containers/{family}.def").read_text()
        files = re.search(r"^%files\n((?:    .*\n)+)", definition, re.MULTILINE).group(1).split()
        assert {*locks[family], INSTALLER} <= set(files[::2]), f"{family}.def"
        assert "jagg_pipeline" not in files, f"{family}.def"
        assert f"/opt/jagg-pipeline/{INSTALLER} {family} --deps-only\n" in definition
        assert "Bootstrap: localimage\nFrom: {{ BASE }}\n" in definition, family
    # No pip call nor version pin of their own: the locks hold every version.
    # containers/ may also hold the images that `make images` links there (*.sif).
    containers = [p for p in (ROOT / "containers").iterdir() if p.suffix != ".sif"]
    recipes = [*(ROOT / "envs").glob("*.yaml"), *containers, ROOT / "Makefile"]
    for path in recipes:
        text = path.read_text()
        assert "pip install" not in text.replace("$(BIN)/pip install uv", ""), path.name
        assert not re.search(r"[A-Za-z0-9]==[0-9]", text), f"{path.name} pins a version"
    assert not (ROOT / "constraints.txt").exists()


def test_dockerfiles_pass_hadolint():
    hadolint = Path(sys.executable).with_name("hadolint")
    dockerfiles = sorted((ROOT / "containers").glob("*.Dockerfile"))
    assert [d.stem for d in dockerfiles] == list(FAMILIES)
    result = subprocess.run(
        [str(hadolint), *map(str, dockerfiles)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_the_summary_family_runs_with_its_lock_alone(reduced_all, tmp_path):
    """`summarize` on real runs with every module the summary lock lacks made unimportable."""
    summary = set(pins(ROOT / "requirements-summary.lock")) | {"jagg-pipeline"}
    blocked = sorted(
        module
        for module, dists in packages_distributions().items()
        if not {canonicalize_name(d) for d in dists} & summary and module.isidentifier()
    )
    assert set(MODEL_LIBRARIES) <= set(blocked)
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {set(blocked)!r}:\n"
        "            raise ImportError(f'{name} is not in requirements-summary.lock')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from jagg_pipeline.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    runs = reduced_all / "results/all"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            blocker,
            "summarize",
            *("--run", "exact", "0", str(runs / "exact/seed-0")),
            *("--run", "jagg", "0", str(runs / "jagg/seed-0")),
            *("--title", "all", "--out", str(tmp_path / "summary")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = (tmp_path / "summary/table.md").read_text()
    assert table == (runs / "summary/table.md").read_text()
