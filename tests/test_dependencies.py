"""The locks against pyproject.toml, and the package's imports against its declarations.

requirements*.lock (written by `make lock`, installed by envs/install.sh) must pin every
requirement of pyproject.toml, its extras included, within its bounds, each pin with hashes
and torch alike in every lock; every third-party module jagg_pipeline imports must be declared
as a run-time dependency (a dev extra is not installed with the package), and every run-time
dependency it does not import must say why it is there (issue 37, items 1 and 2).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from workflow_helpers import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")
# requirements-cpu.lock is written where PyTorch's CPU index is reachable; once there, every
# test here checks it too.
LOCKS = sorted(ROOT.glob("requirements*.lock"))
PIPELINE_LOCKS = [
    lock for lock in LOCKS if lock.name in ("requirements.lock", "requirements-cpu.lock")
]
# Declared run-time dependencies that jagg_pipeline never imports, and why each is there.
NOT_IMPORTED = {
    "sentencepiece": "transformers' T5Tokenizer (toyworld/tiny.py, the Flux and SD3 text encoders)",
    "protobuf": "transformers converts SentencePiece models to fast tokenizers with it",
    "snakemake": "the workflow itself (Snakefile, workflow/): `snakemake` is the pipeline's runner",
    "snakemake-executor-plugin-slurm": "`snakemake --profile slurm` (workflow/profiles/slurm)",
}


def lock_entries(path: Path) -> dict[str, tuple[Requirement, list[str]]]:
    """A lock's entries: canonical name -> (its requirement line, its hashes)."""
    entries = {}
    for line in path.read_text().replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, *options = line.split()
        requirement = Requirement(spec)
        entries[canonicalize_name(requirement.name)] = (requirement, options)
    return entries


def pins(path: Path) -> dict[str, Version]:
    """A lock's exact versions: canonical name -> version."""
    return {
        name: Version(next(iter(requirement.specifier)).version)
        for name, (requirement, _) in lock_entries(path).items()
    }


def declared(extras: bool) -> list[Requirement]:
    """pyproject.toml's requirements: the run-time ones, with every extra's if ``extras``."""
    lines = list(PYPROJECT["dependencies"])
    if extras:
        lines += [line for group in PYPROJECT["optional-dependencies"].values() for line in group]
    return [Requirement(line) for line in lines]


def test_every_lock_line_is_one_exact_pin_with_hashes():
    assert {"requirements.lock", "requirements-summary.lock", "requirements-hpsv2.lock"} <= {
        lock.name for lock in LOCKS
    }
    for lock in LOCKS:
        entries = lock_entries(lock)
        assert entries, f"{lock.name} pins nothing"
        for name, (requirement, options) in entries.items():
            [specifier] = requirement.specifier
            assert specifier.operator == "==" and not requirement.marker, f"{lock.name}: {name}"
            assert options and all(HASH.fullmatch(option) for option in options), (
                f"{lock.name}: {name} has no sha256 hashes ({options}): run `make lock`"
            )


def assert_satisfies(lock: Path, requirements: list[Requirement]) -> None:
    pinned = pins(lock)
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{lock.name} lacks {requirement}: run `make lock`"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"{lock.name} pins {name}=={pinned[name]} outside pyproject.toml's {requirement}:"
            " run `make lock`"
        )


def test_the_pipeline_locks_satisfy_pyproject_and_its_extras():
    assert PIPELINE_LOCKS
    for lock in PIPELINE_LOCKS:
        assert_satisfies(lock, declared(extras=True))


def test_the_summary_lock_is_the_pipeline_lock_cut_to_the_summary_requirements():
    inputs = [
        Requirement(line)
        for line in (ROOT / "envs/summary.in").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    runtime = {canonicalize_name(r.name): r for r in declared(extras=False)}
    for requirement in inputs:
        twin = runtime.get(canonicalize_name(requirement.name))
        assert twin is not None, f"envs/summary.in: {requirement.name} is not in pyproject.toml"
        assert requirement.specifier == twin.specifier, f"envs/summary.in: {requirement} vs {twin}"
    summary = ROOT / "requirements-summary.lock"
    assert_satisfies(summary, inputs)
    pipeline = pins(ROOT / "requirements.lock")
    assert {name: pipeline.get(name) for name in pins(summary)} == pins(summary)
    assert "torch" not in pins(summary)


def test_hpsv2_is_locked_alone():
    assert list(pins(ROOT / "requirements-hpsv2.lock")) == ["hpsv2"]
    assert "hpsv2" not in {canonicalize_name(r.name) for r in declared(extras=True)}


def test_torch_and_torchvision_are_pinned_alike_in_every_lock_that_has_them():
    for package in ("torch", "torchvision"):
        found = {lock.name: pins(lock)[package] for lock in LOCKS if package in pins(lock)}
        assert "requirements.lock" in found, package
        assert len({version.public for version in found.values()}) == 1, found
        # The CUDA build comes from PyPI (no local label), the CPU build from PyTorch's index.
        assert found["requirements.lock"].local is None, found
        if "requirements-cpu.lock" in found:
            assert found["requirements-cpu.lock"].local == "cpu", found


def third_party_imports() -> dict[str, set[str]]:
    """Every top-level module jagg_pipeline imports outside the standard library: -> files."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "jagg_pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "jagg_pipeline":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_a_declared_run_time_dependency():
    imports = third_party_imports()
    assert {"torch", "mlflow", "jsonschema", "requests", "sqlalchemy"} <= set(imports)
    runtime = {canonicalize_name(r.name) for r in declared(extras=False)}
    providers = packages_distributions()
    for module, files in sorted(imports.items()):
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        assert dists, f"{module} (imported by {sorted(files)}) is not installed"
        assert dists & runtime, (
            f"{module} (imported by {sorted(files)}) comes from {sorted(dists)}, none of them in"
            " pyproject.toml's [project] dependencies: declare it there"
        )


def test_every_run_time_dependency_is_imported_or_says_why_not():
    providers = packages_distributions()
    imported = {
        canonicalize_name(dist) for module in third_party_imports() for dist in providers[module]
    }
    unused = {canonicalize_name(r.name) for r in declared(extras=False)} - imported
    assert unused == set(NOT_IMPORTED), (
        "declared in pyproject.toml but never imported by jagg_pipeline, without a reason in"
        f" NOT_IMPORTED: {sorted(unused - set(NOT_IMPORTED))}; listed but now imported or"
        f" undeclared: {sorted(set(NOT_IMPORTED) - unused)}"
    )
