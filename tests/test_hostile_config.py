"""Hostile workflow configs: refused while the Snakefile is parsed, naming the key, with
nothing written anywhere; what a hostile-looking but valid config needs (merge keys, typed
--config values, spaces in paths) works.

Every refusal runs ``snakemake -n`` on the reduced experiment (workflow_helpers.REDUCED) with
one hostile change, in a work folder of its own beside files the hostile values aim at. The
dry runs of the battery run four at a time in one fixture, each in a fresh process forked from
one that imported Snakemake already (the import was most of a dry run's time), and each case
is then its own test.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from stage_helpers import tiny_checkpoint
from workflow_helpers import REDUCED, SNAKEMAKE, snakemake, snakemake_forked, write_config

from jagg_pipeline.config.fields import ConfigError
from jagg_pipeline.config.yaml_io import read_yaml
from jagg_pipeline.workflow.experiments import resolve_runs
from jagg_pipeline.workflow.sections import merge

# The files a hostile value aims at, relative to a case's folder (the work folder is work/).
PWNED = "pwned"
OUTSIDE = "outside"
# A generous bound on one refusal (the parse itself takes well under a second; most of a dry
# run is Snakemake starting up, several seconds on a loaded machine).
REFUSAL_SECONDS = 60

# An alias bomb (a top-level key defining anchors l0..l8): nine levels of nine aliases, about
# 400 million values once expanded, in 1 KB of text.
BOMB = "\n".join(
    [
        "bomb:",
        '  - &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]',
        *(f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)),
    ]
)
# The same as one flow mapping, as --config passes it: 10^7 values.
FLOW_BOMB = (
    "{a: &b0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], "
    + ", ".join(f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 10)}]" for i in range(1, 7))
    + "}"
)


@dataclass(frozen=True)
class Case:
    """A hostile change to the reduced experiment and the key its refusal must name.

    ``change(data, case_folder)`` returns the config data (or YAML text, for what a dict
    cannot carry: aliases, keys YAML types); ``args`` are added to ``snakemake -n``.
    """

    name: str
    change: Callable[[dict, Path], dict | str]
    names: tuple[str, ...]
    args: tuple[str, ...] = ()


def _experiment(data: dict, **fields) -> dict:
    """``data`` with the reduced ``all`` experiment's fields updated."""
    data["workflow"]["experiments"]["all"].update(fields)
    return data


def _sweep(*values) -> Callable[[dict, Path], dict]:
    return lambda data, _: _experiment(
        data, sweep={"key": "jagg.jagg_frac", "values": list(values)}
    )


def _variants(**variants) -> Callable[[dict, Path], dict]:
    return lambda data, _: _experiment(data, variants=variants)


def _workflow(**fields) -> Callable[[dict, Path], dict]:
    def change(data: dict, _: Path) -> dict:
        data["workflow"].update(fields)
        return data

    return change


def _named(name: str) -> Callable[[dict, Path], dict]:
    def change(data: dict, _: Path) -> dict:
        experiments = data["workflow"]["experiments"]
        experiments[name] = experiments.pop("all")
        return data

    return change


def _evaluation(**fields) -> Callable[[dict, Path], dict]:
    def change(data: dict, _: Path) -> dict:
        data["workflow"]["evaluations"] = {"check": fields}
        return data

    return change


def _yaml(old: str, new: str, before: str = "") -> Callable[[dict, Path], str]:
    """YAML text: ``before``, then the config dumped with ``old`` replaced by ``new``."""

    def change(data: dict, _: Path) -> str:
        text = yaml.safe_dump(data, sort_keys=False)
        assert old in text
        return before + text.replace(old, new, 1)

    return change


def _then(*changes: Callable) -> Callable:
    """The changes applied in turn (the last may return YAML text)."""

    def change(data: dict, folder: Path) -> dict | str:
        for one in changes:
            data = one(data, folder)
        return data

    return change


def _in(folder_path: Callable[[Path], str]) -> Callable:
    """A sweep whose one value is ``folder_path(case folder)``."""
    return lambda data, folder: _sweep(folder_path(folder))(data, folder)


def _prompt_file(name: str, content: bytes, section: str = "sampler", **keys) -> Callable:
    def change(data: dict, folder: Path) -> dict:
        path = folder / name
        path.write_bytes(content)
        data[section] = {**data.get(section, {}), "prompts": str(path), **keys}
        return data

    return change


def _backbone(path_of: Callable[[Path], str], family: str = "sd3") -> Callable:
    def change(data: dict, folder: Path) -> dict:
        data["backbone"] = {"family": family, "path": path_of(folder)}
        return data

    return change


def _flux_folder(folder: Path) -> str:
    checkpoint = folder / "flux-checkpoint"
    checkpoint.mkdir()
    (checkpoint / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    return str(checkpoint)


def _guidance_on(family: str, crossed: bool) -> Callable:
    """A Flux-style ``backbone.guidance_scale`` on a tiny ``family`` checkpoint (one per family
    in the battery's folder, built by the first case that asks), set in the base sections and
    either the base's checkpoint or inherited by the one entry of a cross group."""

    def change(data: dict, folder: Path) -> dict:
        path = tiny_checkpoint(family, folder.parent)
        checkpoint = {"family": family, "path": str(path)}
        data["backbone"] = {"guidance_scale": 3.5, **({} if crossed else checkpoint)}
        if crossed:
            entry = {"tiny": {"backbone": checkpoint}}
            data["workflow"]["experiments"]["all"]["cross"] = {"backbone": entry}
        return data

    return change


def _hps_checkpoint(write: Callable[[Path], None]) -> Callable:
    """An HPSv2.1 metric whose checkpoint file ``write`` fills (with something else)."""

    def change(data: dict, folder: Path) -> dict:
        path = folder / "HPS_v2.1_compressed.pt"
        write(path)
        return merge(
            data,
            {
                "eval": {"metrics": ["toy_attributes", "hpsv21"]},
                "rewards": {"hpsv21": {"checkpoint": str(path)}},
            },
        )

    return change


def _safetensors(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(4)}, str(path))


CASES = [
    # 1. no config value reaches a shell or a path outside workflow.results
    Case("sweep-substitution", _in(lambda f: f"x$(touch {f / PWNED})"), ("sweep.values[0]",)),
    Case("sweep-or", _in(lambda f: f"y || touch {f / PWNED} #"), ("sweep.values[0]",)),
    Case("sweep-semicolon", _in(lambda f: f"z; touch {f / PWNED}"), ("sweep.values[0]",)),
    Case("sweep-backquote", _in(lambda f: f"`touch {f / PWNED}`"), ("sweep.values[0]",)),
    Case("sweep-newline", _in(lambda f: f"1\ntouch {f / PWNED}"), ("sweep.values[0]",)),
    Case("sweep-dotdot", _in(lambda f: f"/../../..{f / OUTSIDE}"), ("sweep.values[0]",)),
    Case("sweep-absolute", _in(lambda f: str(f / OUTSIDE)), ("sweep.values[0]",)),
    Case("sweep-mapping", _sweep({"a": 1}), ("sweep.values[0]",)),
    Case("sweep-space", _sweep("a b"), ("sweep.values[0]",)),
    Case("variant-newline", _variants(**{"jagg\n": {}}), ("all.variants: 'jagg\\n'",)),
    Case("variant-dotdot", _variants(**{"..": {}}), ("variants...",)),
    Case("variant-slash", _variants(**{"a/../../b": {}}), ("variants.a/",)),
    Case("variant-space", _variants(**{"my variant": {}}), ("variants.my variant",)),
    Case("variant-dollar", _variants(**{"$(touch pwned)": {}}), ("variants.$(touch",)),
    Case("variant-long", _variants(**{"v" * 200: {}}), ("variants.vvv",)),
    Case(
        "cross-label",
        lambda d, f: _experiment(d, cross={"g": {"a;touch pwned": {}, "b": {}}}),
        ("cross.g.a;touch",),
    ),
    Case("experiment-substitution", _named("x$(touch pwned)"), ("workflow.experiments.x$(",)),
    Case("experiment-newline", _named("all\n"), ("workflow.experiments: 'all\\n'",)),
    Case("experiment-dotted", _named("a.b"), ("workflow.experiments.a.b",)),
    Case("policy-dotdot", _evaluation(policies={"..": {}}), ("policies...",)),
    Case("prompt-set-space", _evaluation(prompts={"a b": {}}), ("prompts.a b",)),
    Case("results-empty", _workflow(results=""), ("workflow.results",)),
    Case("results-blank", _workflow(results="  "), ("workflow.results",)),
    Case("results-root", _workflow(results="/"), ("workflow.results",)),
    Case("results-root-dots", _workflow(results="/../.."), ("workflow.results",)),
    Case("results-dot", _workflow(results="."), ("workflow.results",)),
    Case("results-newline", _workflow(results="res\nults"), ("workflow.results",)),
    Case("results-tilde", _workflow(results="~/results"), ("workflow.results",)),
    Case("toyworld-root-empty", _workflow(toyworld={"root": ""}), ("workflow.toyworld.root",)),
    # 2. hostile YAML
    Case(
        "alias-bomb-values",
        _yaml(
            "    all:\n", "    all:\n      sweep: {key: jagg.jagg_frac, values: *l8}\n", BOMB + "\n"
        ),
        ("alias bomb",),
    ),
    Case(
        "alias-bomb-string",
        _yaml("    all:\n", "    all:\n      description: *l8\n", BOMB + "\n"),
        ("alias bomb",),
    ),
    Case(
        "alias-recursive",
        _yaml("    all:\n", "    all:\n      description: &loop [*loop]\n"),
        ("contains it",),
    ),
    Case(
        "long-value-quoted-short",
        lambda d, f: {**d, "sampler": {"num_steps": "n" * 100_000}},
        ("sampler.num_steps",),
    ),
    Case("config-bad-nested", lambda d, f: d, ("train.rounds",), ("--config", "train={rounds: x}")),
    Case("config-bomb", lambda d, f: d, ("alias bomb",), ("--config", f"train={FLOW_BOMB}")),
    # 3. accepted though wrong
    Case("seeds-twice", lambda d, f: _experiment(d, seeds=[0, 0]), ("seeds", "given twice")),
    Case(
        "sweep-value-twice",
        lambda d, f: _experiment(d, sweep={"key": "jagg.window", "values": [2, 2]}),
        ("sweep.values[1]", "given twice"),
    ),
    Case("sweep-1-and-1.0", _sweep(1, 1.0), ("jagg_frac-1", "same config")),
    Case(
        "sweep-seed",
        lambda d, f: _experiment(d, sweep={"key": "train.seed", "values": [1, 2]}),
        ("sweep.key", "seeds"),
    ),
    Case(
        "variant-sets-seed",
        _variants(a={"train": {"seed": 3}}, b={}),
        ("variants.a.train.seed", "seeds"),
    ),
    Case(
        "overrides-set-seed",
        lambda d, f: _experiment(d, overrides={"train": {"seed": 3}}),
        ("overrides.train.seed",),
    ),
    Case(
        "evaluation-prompts-set-seed", _evaluation(prompts={"p": {"seed": 3}}), ("prompts.p.seed",)
    ),
    Case(
        "variant-key-on",
        _then(_variants(a={}, b={}), _yaml("a: {}", "on: {}")),
        ("variants", "quote it"),
    ),
    Case(
        "variant-key-octal",
        _then(_variants(a={}, b={}), _yaml("a: {}", "010: {}")),
        ("variants", "quote it"),
    ),
    Case(
        "experiment-key-off",
        _then(_named("zzz"), _yaml("zzz:", "off:")),
        ("workflow.experiments", "quote it"),
    ),
    *(
        Case(f"experiment-named-{name}", _named(name), (f"workflow.experiments.{name}",))
        for name in (
            "comparison",
            "bench",
            "toyworld",
            "logs",
            "benchmarks",
            "mlartifacts",
            "score",
            "summary",
            "rollout_transient",
            "compare",
        )
    ),
    Case(
        "experiment-named-like-the-toyworld-folder",
        _then(_workflow(toyworld={"root": "results/tw"}), _named("tw")),
        ("workflow.experiments.tw", "workflow.toyworld.root"),
    ),
    Case(
        "toyworld-root-moved-alone",
        _workflow(
            toyworld={"root": "elsewhere/toyworld", "steps": 30, "batch": 4, "clip_steps": 10}
        ),
        ("backbone.path", "results/toyworld/sd3", "workflow.toyworld.root"),
    ),
    Case(
        "toy-clip-left-behind",
        lambda d, _: merge(
            d,
            {
                "workflow": {"toyworld": {"root": "elsewhere/toyworld"}},
                "backbone": {"path": "elsewhere/toyworld/sd3"},
                "eval": {"metrics": ["toy_attributes", "toy_clipscore"]},
            },
        ),
        ("rewards.toy_clipscore.model", "results/toyworld/clip", "elsewhere/toyworld/clip"),
    ),
    # 4. inputs the config names
    Case(
        "prompts-missing",
        lambda d, f: merge(d, {"sampler": {"prompts": str(f / "missing.txt")}}),
        ("sampler.prompts", "missing.txt"),
    ),
    Case(
        "prompts-empty",
        _prompt_file("empty.txt", b""),
        ("sampler.prompts", "empty.txt", "no prompts"),
    ),
    Case(
        "prompts-blank-lines", _prompt_file("blank.txt", b"\n \n"), ("sampler.prompts", "blank.txt")
    ),
    Case(
        "prompts-no-column",
        _prompt_file("p.csv", b"text\na cat\n", "eval"),
        ("eval.prompts", "p.csv", "no column 'prompt'"),
    ),
    Case(
        "prompts-wrong-column",
        _prompt_file("q.csv", b"prompt\na cat\n", "sampler", prompt_column="caption"),
        ("sampler.prompts", "q.csv", "caption"),
    ),
    Case(
        "prompts-not-utf8",
        _prompt_file("latin1.txt", "caf\xe9 au lait\n".encode("latin-1")),
        ("sampler.prompts", "latin1.txt", "UTF-8"),
    ),
    Case(
        "prompts-nul",
        _prompt_file("nul.txt", b"a cat\na\x00dog\n"),
        ("sampler.prompts", "nul.txt", "NUL"),
    ),
    Case(
        "prompts-json-not-list",
        _prompt_file("p.json", b'{"a": 1}', "eval"),
        ("eval.prompts", "p.json"),
    ),
    Case(
        "prompts-bad-parquet",
        _prompt_file("p.parquet", b"not parquet", "eval"),
        ("eval.prompts", "p.parquet"),
    ),
    Case(
        "prompts-toy-unknown",
        lambda d, f: merge(d, {"eval": {"prompts": "toy:nothing"}}),
        ("eval.prompts", "toy:nothing"),
    ),
    Case(
        "prompts-not-toy-captions",  # the default reward, toy_attributes, parses each one
        _prompt_file("own.txt", b"a red circle on the left, white background\na photo of a cat\n"),
        ("sampler.prompts", "own.txt", "line 2", "toy_attributes in rewards.weights"),
    ),
    Case(
        "backbone-missing",
        _backbone(lambda f: str(f / "no-such-model")),
        ("backbone.path", "no-such-model"),
    ),
    Case(
        "backbone-wrong-family",
        _backbone(_flux_folder),
        ("backbone.path", "FluxPipeline", "backbone.family"),
    ),
    Case(
        "backbone-hub-not-cached",
        _backbone(lambda f: "nobody-here/no-such-model"),
        ("backbone.path", "not in the local cache"),
    ),
    Case(
        "backbone-no-model-index",
        _backbone(str),
        ("backbone.path", "model_index.json not found"),
    ),
    # 5. what the checkpoint's config, the reward model files, the training runs refuse later
    Case(
        "guidance-on-sd3",
        _guidance_on("sd3", crossed=False),
        ("backbone.guidance_scale", "tiny-sd3/transformer/config.json", "all/jagg/seed-0"),
    ),
    Case(
        "guidance-inherited-by-a-qwenimage-cross-entry",
        _guidance_on("qwenimage", crossed=True),
        ("backbone.guidance_scale", "tiny-qwenimage/transformer/config.json", "all/jagg/seed-0"),
    ),
    Case(
        "hps-checkpoint-text",
        _hps_checkpoint(lambda path: path.write_text("version https://git-lfs.github.com/spec\n")),
        ("rewards.hpsv21.checkpoint", "HPS_v2.1_compressed.pt", "not a torch checkpoint"),
    ),
    Case(
        "hps-checkpoint-safetensors",
        _hps_checkpoint(_safetensors),
        ("rewards.hpsv21.checkpoint", "HPS_v2.1_compressed.pt", "is a safetensors file"),
    ),
    Case(
        "evaluated-round-past-train-rounds",
        _evaluation(
            policies={"late": {"checkpoint": "results/all/jagg/seed-0/round-0005/checkpoint"}}
        ),
        (
            "workflow.evaluations.check.policies.late.checkpoint",
            "round 5 of all/jagg/seed-0",
            "check/late/seed-1234",
        ),
    ),
]


@dataclass
class Outcome:
    returncode: int
    output: str  # stdout and stderr: Snakemake prints its errors on stdout
    seconds: float
    written: list[str]
    root_before: set[str]
    root_after: set[str]


def _files(folder: Path) -> set[str]:
    """Every path below ``folder``, Snakemake's own .snakemake/ in the work folder aside."""
    return {
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if ".snakemake" not in path.relative_to(folder).parts
    }


def _prepare(case: Case, folder: Path) -> Path:
    """The work folder of ``case``: the reduced experiment with its hostile change."""
    work = folder / "work"
    work.mkdir(parents=True)
    data = case.change(copy.deepcopy(REDUCED), folder)
    if isinstance(data, str):
        (work / "config.yaml").write_text(data)
    else:
        write_config(work, data)
    return work


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    """Every case's dry run, four at a time, each in a fresh process."""
    base = tmp_path_factory.mktemp("hostile")
    works = {case.name: _prepare(case, base / case.name) for case in CASES}
    before = {name: _files(work.parent) for name, work in works.items()}
    root_before = set(os.listdir("/"))
    calls = {case.name: [str(works[case.name]), "-n", "all", *case.args] for case in CASES}
    done = snakemake_forked(calls, processes=4)
    root_after = set(os.listdir("/"))
    return {
        name: Outcome(
            returncode,
            output,
            seconds,
            sorted(_files(works[name].parent) - before[name]),
            root_before,
            root_after,
        )
        for name, (returncode, output, seconds) in done.items()
    }


def test_the_battery_is_large_and_its_cases_distinct():
    assert len(CASES) >= 50
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.slow  # the battery's dry runs: about 5 minutes on two busy cores
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_hostile_config_is_refused_naming_the_key_and_nothing_is_written(case, outcomes):
    outcome = outcomes[case.name]
    assert outcome.returncode != 0, outcome.output[-2000:]
    for name in case.names:
        assert name in outcome.output, outcome.output[-2000:]
    assert "Traceback" not in outcome.output, outcome.output[-3000:]
    # A hostile value is quoted, not printed: the message stays short.
    assert len(outcome.output) < 20_000, outcome.output[:2000]
    assert outcome.written == [], outcome.written
    assert outcome.root_after <= outcome.root_before
    assert outcome.seconds < REFUSAL_SECONDS


# --- what hostile-looking configs need to work ------------------------------------------------


def test_merge_keys_are_accepted(tmp_path):
    text = yaml.safe_dump(REDUCED, sort_keys=False).replace(
        "      variants:\n",
        "      variants:\n        base: &base {jagg: {mode: jagg, window: 2}}\n"
        "        merged:\n          <<: *base\n          train: {lr: 0.0002}\n",
    )
    (tmp_path / "config.yaml").write_text(text)
    runs = resolve_runs(read_yaml(tmp_path / "config.yaml"))
    merged = runs["all/merged/seed-0"].config
    assert merged.jagg.window == 2 and merged.jagg.mode == "jagg" and merged.train.lr == 2e-4
    done = snakemake(tmp_path, "-n", "all")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "merged" in done.stdout


def test_config_values_are_typed_as_yaml(tmp_path):
    """--config eval='{every: 1}': Snakemake hands a mapping's values over as text ('1'), which
    an integer key refused; the workflow reads them again as YAML."""
    write_config(tmp_path, REDUCED)
    values = ["eval={every: 1}", "train={allow_skipped_round: true, lr: 2.0e-4}"]
    done = snakemake(tmp_path, "-n", "all", "--config", *values)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    # Evaluated after 0, 1 and 2 rounds (every 2 in REDUCED: 0 and 2), for both variants.
    assert re.search(r"^evaluate\s+6$", done.stdout, re.MULTILINE), done.stdout


def test_a_hostile_value_is_quoted_short_in_the_message():
    data = merge(REDUCED, {"sampler": {"num_steps": list(range(50_000))}})
    with pytest.raises(ConfigError) as caught:
        resolve_runs(data)
    assert len(str(caught.value)) < 400 and "..." in str(caught.value)


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB + "\n")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="alias bomb"):
        read_yaml(path)
    assert time.perf_counter() - start < 5


@pytest.mark.slow  # one real job
def test_spaces_in_the_results_folder_and_the_interpreter_path_work(tmp_path):
    """A results folder and a virtual environment whose paths hold a space: the dry run of
    the whole experiment, then one real job (the toy CLIP), logged where it should be."""
    venv = tmp_path / "my venv"
    venv.symlink_to(Path(sys.prefix))
    work = tmp_path / "work dir"
    root = "my results/toy world"
    data = merge(
        REDUCED,
        {
            "backbone": {"path": f"{root}/sd3"},
            "rewards": {"toy_clipscore": {"model": f"{root}/clip"}},
            "workflow": {"results": "my results", "toyworld": {"root": root, "clip_steps": 2}},
        },
    )
    write_config(work, data)
    command = [str(venv / "bin/python"), *SNAKEMAKE[1:], "--directory", str(work)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    dry = subprocess.run([*command, "-n", "all"], capture_output=True, text=True, env=env)
    assert dry.returncode == 0, (dry.stdout + dry.stderr)[-3000:]
    real = subprocess.run(
        [*command, "--cores", "1", f"{root}/clip"], capture_output=True, text=True, env=env
    )
    assert real.returncode == 0, (real.stdout + real.stderr)[-3000:]
    assert (work / root / "clip").is_dir()
    assert (work / "my results/logs/toyworld/clip.log").is_file()
    assert sorted(p.name for p in work.iterdir()) == [".snakemake", "config.yaml", "my results"]


# --- a stage meets a bad prompt file before it loads a model ----------------------------------


def test_evaluate_reads_its_prompts_before_loading_a_model(tmp_path, monkeypatch):
    from jagg_pipeline.config.fields import from_dict
    from jagg_pipeline.config.run import RunConfig
    from jagg_pipeline.io.prompts import PromptFileError
    from jagg_pipeline.stages import policy
    from jagg_pipeline.stages.evaluate import run_evaluate

    def load_policy(*args, **kwargs):
        raise AssertionError("the model was loaded before the prompts were read")

    monkeypatch.setattr(policy, "load_policy", load_policy)
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a cat\n\xff\xfe a dog\n")
    config = from_dict(RunConfig, {"eval": {"prompts": str(prompts)}})
    with pytest.raises(PromptFileError, match=r"prompts\.txt: not UTF-8 text \(byte 6"):
        run_evaluate(config, "base", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_prompt_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("caf\xe9\n".encode("latin-1"))
    config = write_config(tmp_path, {"eval": {"prompts": str(prompts)}})
    start = time.perf_counter()
    command = ["evaluate", "--config", str(config), "--policy", "base", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "jagg_pipeline", *command],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"error: {prompts}: not UTF-8 text (byte 3 is b'\\xe9'); save the file as UTF-8"
    ]
    assert time.perf_counter() - start < REFUSAL_SECONDS
