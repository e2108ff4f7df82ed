"""``verify``: re-hash a finished run's kept files against their manifests; reads only."""

from __future__ import annotations

import argparse
import shlex
import sys
import textwrap
import time
from pathlib import Path

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "re-hash every stage output under a folder against its manifest, naming each bad file"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``verify`` subcommand."""
    p = sub.add_parser(
        "verify",
        help=HELP,
        description=textwrap.dedent(
            """\
            Snakemake decides what to rerun from file times, not contents: a kept file
            that is corrupted after its job finished (a flipped byte, a truncated shard, a
            lost manifest.json) leaves the target "done" until a stage reads the file and
            refuses it. verify finds every stage output under the given folders (each
            folder with a manifest.json, each FILE with FILE.manifest.json), re-hashes
            every file its manifest lists, several at once, and prints one line per
            problem naming the file: missing, corrupt or changed, added after the
            manifest, an unreadable manifest, a finished output that lost its manifest,
            or an output made from an input that now holds other bytes (input paths are
            resolved from the current folder: run it where the workflow runs). It moves,
            rewrites and deletes nothing. Exit status: 0 all verified, 1 a problem found.

            To repair, delete each output it names and ask Snakemake for the target again:
            that job reruns (byte-identical to the first run), then the jobs that read it."""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "paths",
        nargs="*",
        type=Path,
        default=[Path("results")],
        metavar="PATH",
        help="folders (a run, an experiment, results/) or outputs to verify (default: results)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="files hashed at once (default: the usable cores)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the findings as JSON (outputs, files, bytes, problems) to FILE",
    )
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from jagg_pipeline.io.artifacts import atomic_write_json
    from jagg_pipeline.io.audit import audit

    if args.jobs is not None and args.jobs < 1:
        raise SystemExit(f"verify: --jobs {args.jobs}: give 1 or more")
    bar = None

    def progress(total: int):
        nonlocal bar
        bar = tqdm(
            total=total, unit="B", unit_scale=True, desc="verify", file=sys.stderr, disable=None
        )
        return bar.update

    started = time.perf_counter()
    try:
        found = audit(args.paths, jobs=args.jobs, progress=progress)
    except FileNotFoundError as err:
        raise SystemExit(f"verify: {err}") from None
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - started
    if not found.outputs and not found.problems:
        shown = " ".join(str(p) for p in args.paths)
        raise SystemExit(
            f"verify: {shown}: no stage output there (no manifest.json at, above or under it); "
            "give a run folder, an experiment's folder or results/"
        )
    for note in found.unverifiable:
        print(f"UNVERIFIED {note}")
    for problem in found.problems:
        print(f"BAD {problem}")
    if args.json is not None:
        atomic_write_json(
            args.json,
            {
                "outputs": [str(o) for o in found.outputs],
                "files": found.files,
                "bytes": found.bytes,
                **{
                    kind: [
                        {"path": str(p.path), "output": str(p.output), "reason": p.reason}
                        for p in getattr(found, kind)
                    ]
                    for kind in ("problems", "unverifiable")
                },
            },
        )
    checked = len(found.outputs) - len(found.unverifiable)
    unverifiable = f" ({len(found.unverifiable)} unverifiable)" if found.unverifiable else ""
    summary = (
        f"verified {checked} output{'s' * (checked != 1)}{unverifiable}, {found.files} files, "
        f"{found.bytes / 1e6:.1f} MB in {seconds:.1f} s"
    )
    if not found.problems:
        print(f"{summary}: all as their manifests say")
        return 0
    bad = found.bad_outputs
    print(
        f"{summary}: {len(found.problems)} problems in {len(bad)} outputs; nothing was changed. "
        "To rebuild, delete each of these and rerun the target (Snakemake remakes it, then "
        "what reads it):"
    )
    for output in bad:
        print(f"  rm -r {shlex.quote(str(output))}")
    return 1
