"""Per-rule environments and containers: every rule that runs a command names a conda env and a
container of one family that exist, the pins agree with constraints.txt, the Dockerfiles pass
hadolint, and the summary family really runs without torch.

Conda and Apptainer cannot be installed on the CI machines, so what can be checked
without building them is checked here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml
from workflow_helpers import ROOT

from jagg_pipeline.workflow.experiments import ContainersConfig

RULE = re.compile(r"^rule (\w+):\n((?:[ \t]+.*\n|\n)*)", re.MULTILINE)
DIRECTIVE = r"^    {name}:\n\s+(.+)$"
PIN = re.compile(r"\b([A-Za-z0-9_.-]+)==([0-9][A-Za-z0-9_.+-]*)")
FAMILIES = ("pipeline", "summary")
# Imports the summary family's environment does not have.
MODEL_LIBRARIES = ("torch", "torchvision", "diffusers", "transformers", "open_clip", "safetensors")


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


def constraint_pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return dict(PIN.search(line).groups() for line in lines if PIN.search(line))


def test_envs_and_images_pin_what_constraints_pins():
    pins = constraint_pins()
    assert {"torch", "torchvision"} <= set(pins)
    files = [
        *(ROOT / "envs").glob("*.yaml"),
        *(ROOT / "containers").iterdir(),
        ROOT / "Makefile",
    ]
    seen = set()
    for path in files:
        for package, version in PIN.findall(path.read_text()):
            if package in pins:
                assert version == pins[package], f"{path.name} pins {package}=={version}"
                seen.add(path.name)
    # The torch family pins torch everywhere it installs it; and through constraints.txt.
    assert {"pipeline.yaml", "pipeline.Dockerfile", "pipeline.def", "Makefile"} <= seen
    for family in FAMILIES:
        env = yaml.safe_load((ROOT / f"envs/{family}.yaml").read_text())
        assert "python=3.11" in env["dependencies"]
        pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
        for recipe in (f"{family}.Dockerfile", f"{family}.def"):
            text = (ROOT / "containers" / recipe).read_text()
            assert "python:3.11-slim-bookworm" in text, recipe
            assert "--constraint constraints.txt" in text, recipe
        if family == "pipeline":
            assert "--constraint ../constraints.txt" in pip
        else:
            assert not any("torch" in str(item) for item in [*pip, *env["dependencies"]])


def test_dockerfiles_pass_hadolint():
    hadolint = Path(sys.executable).with_name("hadolint")
    dockerfiles = sorted((ROOT / "containers").glob("*.Dockerfile"))
    assert [d.stem for d in dockerfiles] == list(FAMILIES)
    result = subprocess.run(
        [str(hadolint), *map(str, dockerfiles)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_the_summary_family_runs_without_the_model_libraries(reduced_all, tmp_path):
    """`summarize` on real runs with torch, diffusers, ... made unimportable."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {MODEL_LIBRARIES!r}:\n"
        "            raise ImportError(f'{name} is not in the summary environment')\n"
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
