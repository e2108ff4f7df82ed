"""``rewards``: load the reward models a config uses, and nothing else, to check their files.

Owns the check a researcher runs before submitting a job: every reward of the config (the
``rewards.weights`` keys, then ``eval.metrics``; or ``--names``) is loaded through the
registry's own loader (:func:`jagg_pipeline.rewards.load_reward`, so the check cannot pass
where the stages would fail) on the device the stages use, one line is printed per reward,
and the model is released before the next one loads. Nothing is sampled or scored. Every
reward is tried; each failure is one ``error:`` line naming the config key and the path, with
the expected layout in ``docs/reward-models.md``.

``rewards --build-tiny DIR`` instead writes tiny HPSv2.1 / PickScore / CLIPScore models in
their real formats (:mod:`jagg_pipeline.rewards.tiny`) for trying the real reward path offline,
and prints the config that points at them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jagg_pipeline.cli.common import add_config_arguments

if TYPE_CHECKING:
    from jagg_pipeline.config.run import RunConfig

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "load the config's reward models (nothing scored) to check their files"

# Where each reward's expected files are written down; every failure points at its section.
LAYOUT_DOC = "docs/reward-models.md"

# Wide enough for every registered name (jpeg_compressibility), so the columns line up.
_NAME_WIDTH = 20


def _names(text: str) -> list[str]:
    """``--names a,b``: registered reward names, in the order given, without repeats."""
    from jagg_pipeline.config.run import REWARD_NAMES

    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in REWARD_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown) or repr(text)}: not a reward name; known rewards: "
            f"{', '.join(REWARD_NAMES)}"
        )
    return names


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``rewards`` subcommand."""
    p = sub.add_parser(
        "rewards",
        help=HELP,
        description=textwrap.dedent(
            """\
            Load every reward model the config uses (the rewards.weights keys, then
            eval.metrics; or --names) with the stages' own loaders, on the device the stages
            use, and print one line per reward. Nothing is sampled or scored; each model is
            released before the next loads. Every reward is tried: each one that fails is an
            `error:` line naming the config key and the path to fix. Accepts the workflow's
            config.yaml (its base sections; an experiment's variant overrides are not applied,
            give them with --set).

            --build-tiny DIR instead writes tiny HPSv2.1, PickScore and CLIPScore models in
            their real formats to DIR (randomly initialised, trained for seconds on solid
            colours: for trying the real reward path offline, never for scores that mean
            anything), with DIR/tiny-rewards.yaml, the rewards and eval.metrics config that
            uses them, and prints that config."""
        ),
        epilog=textwrap.dedent(
            f"""\
            output: one line per loaded reward
              NAME  DEVICE  DTYPE  PARAMETERS params  SECONDS s  FIELD=SOURCE ...
            where SOURCE is the absolute local path a model setting names, the file or
            snapshot folder in the Hugging Face cache that a hub id resolved to, or the value
            as given (an open_clip model name). SECONDS includes importing the model library
            for the first reward that needs it. Exit status 0 when every reward loads, 1
            otherwise.

            With HF_HUB_OFFLINE=1 a hub id is only looked up in the local cache, so a missing
            model fails at once. Expected files per reward, and how to download them:
            {LAYOUT_DOC}.

            --build-tiny refuses a DIR that is not empty unless an earlier --build-tiny wrote
            it (it holds tiny-rewards.yaml), and replaces such a DIR whole; the models are
            written beside DIR first and renamed into place, so DIR is never half written."""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # --config is required unless --build-tiny is given: _run checks that one of them is.
    add_config_arguments(p, required=False)
    p.add_argument(
        "--build-tiny",
        type=Path,
        metavar="DIR",
        help="write tiny real-format hpsv21, pickscore and clipscore models to DIR and print "
        "the config that uses them, instead of checking a config",
    )
    p.add_argument(
        "--device",
        help="torch device of the reward models (default: the config's rewards.device, else "
        "backbone.device)",
    )
    p.add_argument(
        "--names",
        type=_names,
        metavar="A,B",
        help="load these rewards instead of the config's (their settings still come from the "
        "config's rewards section), e.g. hpsv21,pickscore",
    )
    p.set_defaults(handler=_run)


def _config_rewards(config: RunConfig) -> list[str]:
    """The rewards a config uses: the ``rewards.weights`` keys, then ``eval.metrics``."""
    return list(dict.fromkeys([*config.rewards.weights, *config.eval.metrics]))


def _device(requested: str | None, config: RunConfig) -> tuple[str, str]:
    """The reward models' device and the setting it came from (for errors)."""
    if requested:
        return requested, "--device"
    source = "rewards.device" if config.rewards.device else "backbone.device"
    return config.rewards.resolve_device(config.backbone.device), source


def _check_device(device: str, source: str) -> Any:
    """``device`` as a torch device, or an InputError naming ``source`` if it is unusable here.

    Checked before any model loads: otherwise every reward would fail with the same CUDA
    error, after reading its weights.
    """
    import torch

    from jagg_pipeline.support.errors import InputError

    try:
        torch_device = torch.device(device)
    except RuntimeError as err:
        raise InputError(f"{source}: {device!r} is not a torch device ({err})") from None
    if torch_device.type == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = torch_device.index or 0
        if index >= visible:
            raise InputError(
                f"{source}: {device} needs CUDA device {index}, but {visible} are visible "
                "here; pass --device cpu to check the files on this machine"
            )
    return torch_device


def _source_of(value: str) -> str:
    """Where a model setting's value resolves to, without loading or downloading anything.

    An existing local path: its absolute path. A hub id (``owner/name`` or
    ``owner/name/file``, see :mod:`jagg_pipeline.config.sources`): the cached file, or the cached
    snapshot folder, it resolved to. Anything else (an open_clip model name): as given.
    """
    from jagg_pipeline.config.sources import HUB_FILE, HUB_REPO

    path = Path(value).expanduser()
    if path.exists():
        return str(path.resolve())
    if HUB_FILE.match(value) or HUB_REPO.match(value):
        from huggingface_hub import try_to_load_from_cache

        match = HUB_FILE.match(value)
        if match:
            probes = [(match["repo"], match["file"])]
        else:
            # A from_pretrained folder holds one of these: a model's config, or a processor's.
            names = ("config.json", "preprocessor_config.json", "tokenizer_config.json")
            probes = [(value, name) for name in names]
        for repo, name in probes:
            cached = try_to_load_from_cache(repo, name)
            if isinstance(cached, str):
                return cached if match else str(Path(cached).parent)
        return f"{value} (hub id, not in the local cache)"
    return value


def _spec_sources(spec: Any) -> list[str]:
    """``field=source`` for each model setting of a reward spec (its string fields but dtype).

    A None setting (clipscore's ``processor``) means "the model's own" and is left out.
    """
    return [
        f"{field.name}={_source_of(getattr(spec, field.name))}"
        for field in dataclasses.fields(spec)
        if field.name != "dtype" and isinstance(getattr(spec, field.name), str)
    ]


def _describe(name: str, reward: Any, spec: Any, seconds: float) -> str:
    """The line printed for one loaded reward."""
    parameters = [p for module in reward.modules for p in module.parameters()]
    devices = sorted({str(p.device) for p in parameters}) or [str(getattr(reward, "device", "-"))]
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in parameters}) or ["-"]
    count = sum(p.numel() for p in parameters)
    sources = _spec_sources(spec) or ["(no model files)"]
    return (
        f"{name:<{_NAME_WIDTH}} {','.join(devices):<8} {','.join(dtypes):<9} "
        f"{count:>13,} params {seconds:7.2f} s  {'  '.join(sources)}"
    )


def _load_and_describe(name: str, spec: Any, device: Any) -> str:
    """Load reward ``name`` from ``spec`` onto ``device``, describe it, and release it."""
    import gc

    import torch

    from jagg_pipeline.rewards import load_reward

    start = time.perf_counter()
    reward = load_reward(name, spec, device)
    line = _describe(name, reward, spec, time.perf_counter() - start)
    # Released before the next reward loads: the check needs one model in memory at a time.
    del reward
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return line


def _refuse_foreign(target: Path) -> None:
    """Refuse ``target`` unless it is new, an empty folder, or an earlier tiny build."""
    from jagg_pipeline.rewards.tiny import MANIFEST
    from jagg_pipeline.support.errors import InputError

    if not target.exists():
        return
    if not target.is_dir():
        raise InputError(f"--build-tiny {target}: not a folder; nothing was changed")
    if any(target.iterdir()) and not (target / MANIFEST).is_file():
        raise InputError(
            f"--build-tiny {target}: the folder is not empty and holds no {MANIFEST}, so an "
            "earlier --build-tiny did not write it; give a new or empty folder (nothing was "
            "changed)"
        )


def _build_tiny(target: Path) -> int:
    """Write the tiny reward models to ``target`` atomically, then print the config using them."""
    import yaml

    from jagg_pipeline.cli.common import stage_errors
    from jagg_pipeline.io.artifacts import atomic_directory
    from jagg_pipeline.rewards.tiny import (
        MANIFEST,
        TINY_REWARDS,
        build_tiny_reward,
        tiny_rewards_config,
    )

    with stage_errors():
        _refuse_foreign(target)
    print(f"building {len(TINY_REWARDS)} tiny reward models into {target}", flush=True)
    # The config names the final folder, not the staging one it is written in.
    snippet = yaml.safe_dump(tiny_rewards_config(target), sort_keys=False)
    # stage_errors: an unwritable folder or a full disk is one `error:` line naming the output.
    with stage_errors(), atomic_directory(target) as staging:
        for name in TINY_REWARDS:
            start = time.perf_counter()
            build_tiny_reward(name, staging / name)
            print(f"{name:<{_NAME_WIDTH}} {time.perf_counter() - start:6.1f} s", flush=True)
        (staging / MANIFEST).write_text(
            "# Tiny reward models in real formats (rewards --build-tiny), trained for seconds on\n"
            "# solid colours: for trying the real reward path offline; their scores mean nothing.\n"
            + snippet
        )
    manifest = target.resolve() / MANIFEST
    print(
        f"wrote {target.resolve()}; {manifest} holds this config (check it with "
        f"`python -m jagg_pipeline rewards --config {manifest}`), copy it into yours:\n"
    )
    print(snippet, end="")
    return 0


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.cli.common import load_stage_config, stage_errors
    from jagg_pipeline.support.errors import InputError

    if args.build_tiny is not None:
        check_options = {
            "--config": args.config,
            "--set": args.overrides,
            "--device": args.device,
            "--names": args.names,
        }
        given = [flag for flag, value in check_options.items() if value]
        if given:
            raise SystemExit(f"error: --build-tiny takes no {', '.join(given)}")
        return _build_tiny(args.build_tiny)
    if args.config is None:
        raise SystemExit("error: give --config FILE (check its rewards) or --build-tiny DIR")
    config = load_stage_config(args.config, args.overrides)
    names = args.names or _config_rewards(config)
    device, source = _device(args.device, config)
    with stage_errors():
        torch_device = _check_device(device, source)
    print(
        f"loading {len(names)} reward model(s) of {args.config} on {device} ({source})", flush=True
    )
    failed = []
    for name in names:
        try:
            line = _load_and_describe(name, config.rewards.spec(name), torch_device)
        # The loaders' errors that a setting can fix (RewardConfigError is an InputError);
        # anything else is a bug and keeps its traceback, as in every stage.
        except (InputError, FileNotFoundError) as err:
            failed.append(name)
            # One line per failure: transformers' messages span several.
            message = " ".join(str(err).split())
            print(f"error: {message}; expected layout: {LAYOUT_DOC}#{name}", file=sys.stderr)
            continue
        print(line, flush=True)
    if failed:
        print(
            f"error: {len(failed)} of {len(names)} reward model(s) failed to load: "
            f"{', '.join(failed)}",
            file=sys.stderr,
        )
        return 1
    print(f"all {len(names)} reward model(s) loaded")
    return 0
