"""The checks before any job: what every resolved run names, read as its stages will need it.

The workflow runs :func:`check_runs` while the Snakefile is parsed (and ``config check`` runs
it too), so that a config a stage would refuse is refused at once, not minutes into a job:

- each prompt file (``sampler.prompts`` of a training run, ``eval.prompts``), read whole as
  its stage reads it; where a reward that reads prompts as toy-world captions scores it
  (:data:`CAPTION_REWARDS`: ``rewards.weights`` the training prompts, ``eval.metrics`` the
  first ``eval.max_prompts`` evaluation prompts), every prompt it scores parsed as one;
- each ``backbone.path`` that no toy-world rule builds: a checkpoint of its family
  (:func:`~jagg_pipeline.config.sources.check_pipeline_dir`);
- each backbone's settings against its checkpoint's ``transformer/config.json`` (read as
  JSON), with the refusals the backbones make at load
  (:func:`~jagg_pipeline.config.checkpoints.option_problems`);
- each reward model a run uses (``rewards.weights`` of a training run, ``eval.metrics``):
  the files its settings name (:data:`REWARD_FILES`), present and of the format its loader
  reads, by their headers (:mod:`.model_files`); a hub id is not looked up;
- each checkpoint an evaluation names inside a training run: a round the run trains.

Nothing is loaded and nothing is downloaded. Each problem is one line naming the key, the
file and the runs that meet it; each input is checked once, however many runs share it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path

from jagg_pipeline.config.checkpoints import TRANSFORMER_CONFIG, option_problems
from jagg_pipeline.config.fields import ConfigError
from jagg_pipeline.config.run import BackboneConfig, RewardsConfig, RunConfig
from jagg_pipeline.config.sources import HUB_REPO, check_pipeline_dir, local_or_hub
from jagg_pipeline.io.artifacts import ROUND_FOLDER
from jagg_pipeline.io.prompts import PromptFileError, check_prompts, prompt_place
from jagg_pipeline.rewards.toy_scene import ALL_ATTRIBUTES, parse_caption
from jagg_pipeline.support.errors import shown
from jagg_pipeline.workflow.layout import toyworld_inputs
from jagg_pipeline.workflow.model_files import (
    hf_model_problem,
    hf_processor_problem,
    json_problem,
    torch_checkpoint_problem,
)
from jagg_pipeline.workflow.names import WORKFLOW_KEY
from jagg_pipeline.workflow.runs import Run
from jagg_pipeline.workflow.sections import WorkflowConfig

# A line of a check: (the function, its arguments), hashable so that shared inputs run once.
Check = tuple[Callable[..., str | None], tuple]


@dataclass(frozen=True)
class ModelFile:
    """What a reward setting names, as its loader reads it, and how its headers are checked.

    ``problem``: the header check of the local file or folder (None: fine). ``hub``: whether a
    value shaped like a hub id is one (then it is not looked up: nothing is downloaded here).
    ``applies``: whether a value names a file at all (an open_clip architecture may be a name).
    """

    folder: bool
    problem: Callable[[Path], str | None]
    hub: bool = True
    applies: Callable[[str], bool] = lambda value: True


def _clip_folder(folder: Path) -> str | None:
    return hf_model_problem(folder, "clip") or hf_processor_problem(folder)


_CLIP_MODEL = ModelFile(True, partial(hf_model_problem, model_type="clip"))
_CLIP_PROCESSOR = ModelFile(True, hf_processor_problem)
# Reward setting (reward, field) -> the model file it names: every string setting of every
# registered reward but ``dtype`` is here or in NO_MODEL_FILES (a test keeps the two whole).
REWARD_FILES: dict[tuple[str, str], ModelFile] = {
    # torch.load of {"state_dict": ...} (hpsv21.load_open_clip), open_clip's CLIP keys.
    ("hpsv21", "checkpoint"): ModelFile(
        False, partial(torch_checkpoint_problem, names=("state_dict", "logit_scale"))
    ),
    ("hpsv21", "arch"): ModelFile(
        False, json_problem, hub=False, applies=lambda value: value.endswith(".json")
    ),
    ("pickscore", "model"): _CLIP_MODEL,
    ("pickscore", "processor"): _CLIP_PROCESSOR,
    ("clipscore", "model"): _CLIP_MODEL,
    ("clipscore", "processor"): _CLIP_PROCESSOR,  # null: the model's folder holds it
    # Built by the toy world's rule (then not checked here), never a hub id.
    ("toy_clipscore", "model"): ModelFile(True, _clip_folder, hub=False),
}
NO_MODEL_FILES: frozenset[str] = frozenset({"jpeg_compressibility", "toy_attributes"})
# Rewards that score only toy-world captions (toy_attributes takes its truth from the
# caption); toy_clipscore's tokenizer reads any text.
CAPTION_REWARDS: frozenset[str] = frozenset({"toy_attributes"})


def check_runs(runs: Iterable[Run], workflow: WorkflowConfig) -> list[str]:
    """What is wrong with the inputs the runs name, one line per problem (empty: nothing).

    Each line names the key, the file and the runs that meet it (three, then a count).
    """
    runs = list(runs)
    trained = {os.path.abspath(run.directory): run for run in runs if run.policy is None}
    problems: dict[str, str | None] = {}
    users: dict[str, list[str]] = {}
    for run in runs:
        for function, args in _checks(run, workflow, trained):
            what = repr((function, args))  # by value: a backbone section is no dict key
            if what not in problems:
                problems[what] = function(*args)
            if problems[what] is not None:
                users.setdefault(problems[what], []).append(run.run_id)
    return [
        f"{problem} (run{'s' if len(ids) > 1 else ''} {', '.join(ids[:3])}"
        f"{f' and {len(ids) - 3} more' if len(ids) > 3 else ''})"
        for problem, ids in users.items()
    ]


def _checks(run: Run, workflow: WorkflowConfig, trained: Mapping[str, Run]) -> list[Check]:
    """The checks of one run's inputs."""
    config = run.config
    root = workflow.toyworld.root
    ev = config.eval
    scorer = _caption_scorer("eval.metrics", ev.metrics)
    prompts = [("eval.prompts", "eval.column", ev.prompts, ev.column, scorer, ev.max_prompts)]
    if run.policy is None:
        sampler = config.sampler
        column = sampler.prompt_column
        scorer = _caption_scorer("rewards.weights", config.rewards.weights)
        prompts.append(
            ("sampler.prompts", "sampler.prompt_column", sampler.prompts, column, scorer, None)
        )
    checks: list[Check] = [(_prompt_problem, args) for args in prompts]
    toy = toyworld_inputs(config, root)
    spec = config.backbone
    if "toy_backbone" not in toy:
        checks.append((_backbone_problem, (spec.family, spec.path, spec.revision, root)))
    checks.append((_options_problem, (spec,)))
    for key, value, kind in _reward_files(config, training=run.policy is None):
        if key != "rewards.toy_clipscore.model" or "toy_clip" not in toy:
            checks.append((_model_file_problem, (key, value, kind, root)))
    if run.policy is not None and run.policy != "base":
        checks += _round_check(run, workflow, trained)
    return checks


def _caption_scorer(key: str, rewards: Iterable[str]) -> tuple[str, str] | None:
    """(``key``, reward) of the first of ``rewards`` that scores only toy captions, or None."""
    return next(((key, name) for name in rewards if name in CAPTION_REWARDS), None)


def _prompt_problem(
    key: str,
    column_key: str,
    source: str,
    column: str | None,
    scorer: tuple[str, str] | None,
    scored: int | None,
) -> str | None:
    """A prompt source, read whole as its stage reads it, and its toy captions if need be.

    ``scorer``: (the key, the reward) that scores the source's first ``scored`` prompts
    (None: all) as toy-world captions; None: no such reward scores it.
    """
    try:
        prompts = check_prompts(source, column)
    except PromptFileError as err:
        return f"{key}: {err}; fix {key} or {column_key}"
    if scorer is None or prompts is None:  # a toy set holds toy captions only
        return None
    for number, prompt in enumerate(prompts[:scored], 1):
        try:
            parse_caption(prompt)
        except ValueError:
            rewards, reward = scorer
            return (
                f"{key}: {source}: {prompt_place(source, number)}, {shown(prompt)}, is not a "
                f"toy-world caption, and {reward} in {rewards} scores only those; put a real "
                f"reward model in {rewards}, or use toy captions (such as "
                f"{ALL_ATTRIBUTES[0].caption()!r}, or the sets toy:train / toy:heldout)"
            )
    return None


def _backbone_problem(family: str, path: str, revision: str | None, root: str) -> str | None:
    """``backbone.path``: a checkpoint of ``family`` (a local folder, or a cached hub id)."""
    key = "backbone.path"
    try:
        check_pipeline_dir(key, path, family, revision)
    except ConfigError as err:
        if family not in Path(path).parts[-1:]:
            return str(err)
        return (
            f"{err} (the workflow builds the toy {family} backbone at {root}/{family}, "
            "from workflow.toyworld.root)"
        )
    return None


def _options_problem(spec: BackboneConfig) -> str | None:
    """The backbone's settings against its checkpoint's transformer config, where it is here.

    A local folder's ``transformer/config.json``, or a hub id's in the local cache; a
    checkpoint not there yet (a toy world to build, a hub id to download) is checked at load.
    """
    if HUB_REPO.fullmatch(spec.path) and not Path(spec.path).exists():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(spec.path, TRANSFORMER_CONFIG, revision=spec.revision)
        file = Path(cached) if isinstance(cached, str) else None
    else:
        file = Path(spec.path, TRANSFORMER_CONFIG)
    if file is None or not file.is_file():
        return None  # not there (yet): the backbone.path check or the load names it
    problem = json_problem(file)
    if problem:
        return f"{spec.key}.path={shown(spec.path)}: {problem}"
    return "; ".join(option_problems(spec, json.loads(file.read_text()), str(file))) or None


def _reward_files(config: RunConfig, training: bool) -> list[tuple[str, str, ModelFile]]:
    """(key, value, what it names) of each model file the rewards a run uses name.

    A training run scores ``rewards.weights`` and evaluates ``eval.metrics``; an evaluation
    run only evaluates.
    """
    used = [*config.rewards.weights] if training else []
    found = []
    for name in dict.fromkeys([*used, *config.eval.metrics]):
        spec = config.rewards.spec(name)
        for (reward, setting), kind in REWARD_FILES.items():
            if reward != name:
                continue
            key, value = f"rewards.{name}.{setting}", getattr(spec, setting)
            if value is None:  # clipscore's processor: the model's own
                key, value = f"rewards.{name}.model (rewards.{name}.{setting} is null)", spec.model
            if kind.applies(value):
                found.append((key, value, kind))
    return found


def _model_file_problem(key: str, value: str, kind: ModelFile, root: str) -> str | None:
    """A reward setting's file or folder: present and, by its headers, of the right format."""
    setting = key.split(" ")[0]
    reward, field = setting.split(".")[1:]
    wanted = _help(reward, field)
    try:
        if not kind.hub and not Path(value).exists():
            raise ConfigError(f"{setting}: {shown(value)} not found; set it to {wanted}")
        source = local_or_hub(setting, value, wanted, kind.folder, ConfigError)
    except ConfigError as err:
        problem = str(err)
    else:
        if not isinstance(source, Path):
            return None  # a hub id: its loader resolves it (nothing is downloaded here)
        found = kind.problem(source)
        problem = None if found is None else f"{key}={shown(value)}: {found}"
    if problem and reward == "toy_clipscore":
        return (
            f"{problem}; the workflow builds the toy CLIP at {root}/clip, from "
            f"workflow.toyworld.root: point {setting} there or at a CLIP folder of your own"
        )
    return problem


def _help(reward: str, setting: str) -> str:
    """What a reward setting should hold: its field's help text."""
    spec = type(RewardsConfig().spec(reward))
    return next(f.metadata["help"] for f in fields(spec) if f.name == setting)


def _round_check(run: Run, workflow: WorkflowConfig, trained: Mapping[str, Run]) -> list[Check]:
    """An evaluation's checkpoint inside a training run: the check that the run trains it.

    Snakemake would otherwise make the checkpoint by training the run on, past its
    ``train.rounds``, without a word. Nothing to check for a checkpoint of no run here.
    """
    policy = os.path.abspath(run.policy)
    owner = next((r for d, r in trained.items() if policy.startswith(d + os.sep)), None)
    if owner is None:
        return []
    folder = os.path.relpath(policy, os.path.abspath(owner.directory)).split(os.sep)[0]
    match = ROUND_FOLDER.fullmatch(folder)
    if match is None:
        return []
    label = next(
        (
            label
            for label, entry in workflow.evaluations[run.experiment].policies.items()
            if os.path.abspath(str(entry.get("checkpoint", ""))) == policy
        ),
        "*",
    )
    key = f"{WORKFLOW_KEY}.evaluations.{run.experiment}.policies.{label}.checkpoint"
    args = (key, run.policy, int(match[1]), owner.run_id, owner.config.train.rounds)
    return [(_round_problem, args)]


def _round_problem(key: str, checkpoint: str, index: int, owner: str, rounds: int) -> str | None:
    """Round ``index`` of training run ``owner``: one of its ``rounds``."""
    if index < rounds:
        return None
    return (
        f"{key}: {shown(checkpoint)} is round {index} of {owner}, which trains rounds 0 to "
        f"{rounds - 1} (its train.rounds is {rounds}): the workflow would train it "
        f"{index + 1 - rounds} round(s) further to make it; name one of its rounds"
    )
