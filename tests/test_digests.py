"""Digests recorded while writing, manifests that read nothing back, and counted verification.

Every writer of a data file records the digest of the bytes it writes; these tests compare
each with the file read back and hashed here by blake3 or hashlib directly (not through the
package), count what the package hashed by reading (``manifest.hash_counts``), and keep the
manifests written before the algorithm was named (sha256) verifying.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from blake3 import blake3
from train_helpers import make_config

from jagg_pipeline.config.run import RunConfig
from jagg_pipeline.io import shards
from jagg_pipeline.io.artifacts import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_safetensors,
    atomic_write_text,
    recorded_digest,
)
from jagg_pipeline.io.figures import pyplot, save_figure, save_png
from jagg_pipeline.io.manifest import (
    ManifestError,
    check_derived_from,
    check_input,
    digest_path,
    file_digest,
    hash_counts,
    read_manifest,
    recorded_digests,
    reset_hash_counts,
    verify_files,
    write_manifest,
)
from jagg_pipeline.io.tables import write_table
from jagg_pipeline.io.trajectories import TrajectoryBatch


def b3(path: Path) -> str:
    return blake3(path.read_bytes()).hexdigest()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def damage(path: Path, how: str = "flipped") -> None:
    """Flip a byte in the data or cut the file, as a new file (a copy, an editor's save).

    A new inode: an in-place rewrite to the same size within one timestamp tick of the last
    hashing would look unchanged to this process's cache of digests.
    """
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[len(data) * 3 // 4] ^= 1
    else:
        del data[len(data) // 2 :]
    path.unlink()
    path.write_bytes(bytes(data))


def reads() -> dict[str, int]:
    """What the package hashed by reading files: path -> bytes."""
    return {path: entry["bytes"] for path, entry in hash_counts()["read"]["paths"].items()}


def trajectories(n: int = 4, steps: int = 3) -> TrajectoryBatch:
    g = torch.Generator().manual_seed(0)
    return TrajectoryBatch(
        latents=torch.randn(n, steps + 1, 2, 4, 4, generator=g),
        log_probs=torch.randn(n, steps, generator=g),
        sigmas=torch.linspace(1, 0, steps + 1),
        sde_mask=torch.tensor([True, True, False]),
        train_mask=torch.tensor([True, False, False]),
        prompt_ids=torch.arange(n) // 2,
        group_ids=torch.arange(n) // 2,
        seeds=torch.arange(n),
        prompts=["a", "b"],
        cond={"prompt_embeds": torch.randn(n, 5, 6, generator=g).to(torch.bfloat16)},
        images=torch.randint(0, 255, (n, 3, 8, 8), generator=g, dtype=torch.uint8),
    )


def write_everything(folder: Path) -> list[Path]:
    """One file from every writer of the package's data files; their paths."""
    from PIL import Image

    rows = [{"sample": i, "reward": 0.5 * i, "prompt": f"p{i}"} for i in range(5)]
    written = [
        atomic_write_text(folder / "config.yaml", "a: 1\nb: é\n"),
        atomic_write_json(folder / "summary.json", {"mean": 0.25}),
        atomic_write_bytes(folder / "blob.bin", os.urandom(3000)),
        write_table(folder / "scores.parquet", rows),
        write_table(folder / "samples.jsonl", rows),
        write_table(folder / "table.csv", rows),
        atomic_write_safetensors(folder / "rng.safetensors", {"x": torch.arange(7)}),
        trajectories().save(folder, rank=0),
        folder / "shard-0.json",
    ]
    image = Image.fromarray(torch.randint(0, 255, (8, 8, 3), dtype=torch.uint8).numpy())
    written.append(save_png(image, folder / "images" / "0000_00.png"))
    written.append(save_figure(pyplot().figure(), folder / "curves.png"))
    state = {"w": torch.randn(6, 3), "opt": {"step": torch.tensor(2.0), "lr": 0.1}}
    shards.save(state, folder / "policy")
    written += sorted((folder / "policy").iterdir())
    return written


def test_every_writer_records_the_digest_of_the_bytes_it_wrote(tmp_path):
    reset_hash_counts()
    written = write_everything(tmp_path)
    assert {p.name for p in written} >= {".metadata", "__0_0.distcp", "shard-0.safetensors"}
    for path in written:
        assert recorded_digest(path) == b3(path), path
        assert recorded_digest(path, "sha256") is None  # recorded in one algorithm
    counts = hash_counts()
    assert counts["read"]["files"] == 0  # nothing was read to hash it
    assert counts["written"]["files"] >= len(written)
    assert counts["written"]["bytes"] >= sum(p.stat().st_size for p in written)
    # A rewrite in place (same inode) moves size or mtime: its old digest no longer applies.
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"other bytes")
    assert recorded_digest(blob) is None


def test_writers_that_now_write_from_memory_write_the_same_bytes(tmp_path):
    """Parquet, PNG and safetensors made in memory equal what their writers put in a file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image
    from safetensors.torch import load_file, save_file

    rows = [{"sample": i, "reward": 0.5 * i} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "direct.parquet")
    write_table(tmp_path / "ours.parquet", rows)
    image = Image.fromarray(torch.randint(0, 255, (16, 16, 3), dtype=torch.uint8).numpy())
    image.save(tmp_path / "direct.png", format="PNG")
    save_png(image, tmp_path / "ours.png")
    trajectories().save(tmp_path, rank=3)
    save_file(load_file(tmp_path / "shard-3.safetensors"), tmp_path / "direct.safetensors")
    for direct, ours in [
        ("direct.parquet", "ours.parquet"),
        ("direct.png", "ours.png"),
        ("direct.safetensors", "shard-3.safetensors"),
    ]:
        assert (tmp_path / direct).read_bytes() == (tmp_path / ours).read_bytes(), ours


def test_a_manifest_reads_back_only_the_files_nobody_recorded(tmp_path):
    out = tmp_path / "out"
    written = write_everything(out)
    (out / "by_hand.txt").write_bytes(b"written by another program")  # nobody recorded it
    reset_hash_counts()
    write_manifest(out, stage="rollout", config=RunConfig())
    assert reads() == {str((out / "by_hand.txt").resolve()): 26}
    manifest = read_manifest(out)
    assert manifest["digest_algorithm"] == "blake3"
    names = {p.relative_to(out).as_posix() for p in written} | {"by_hand.txt"}
    assert set(manifest["files"]) == names  # the DCP index among them
    for name, digest in manifest["files"].items():
        assert digest == b3(out / name), name


def test_digests_recorded_by_other_processes_are_taken_as_they_are(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "theirs.bin").write_bytes(b"another rank's shard")
    atomic_write_text(out / "ours.txt", "rank 0")
    reset_hash_counts()
    theirs = {"theirs.bin": blake3(b"another rank's shard").hexdigest()}
    write_manifest(out, stage="train", config=RunConfig(), recorded=theirs)
    assert reads() == {}
    assert read_manifest(out)["files"] == {"ours.txt": b3(out / "ours.txt"), **theirs}
    assert recorded_digests(out) == {"ours.txt": b3(out / "ours.txt")}
    with pytest.raises(ValueError, match="recorded for files it lacks"):
        write_manifest(out, stage="train", config=RunConfig(), recorded={"gone.bin": "00"})


def _old_folder_digest(folder: Path) -> str:
    """digest_path of a folder as the package computed it before blake3 (sha256)."""
    h = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json"):
        h.update(file.relative_to(folder).as_posix().encode() + b"\0" + sha256(file).encode())
        h.update(b"\n")
    return h.hexdigest()


def _old_manifest(output: Path, **fields) -> None:
    """A manifest as written before ``digest_algorithm``: sha256 digests, no algorithm key."""
    files = {
        p.relative_to(output).as_posix(): sha256(p)
        for p in sorted(output.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }
    config = RunConfig()
    from jagg_pipeline.config.fields import digest
    from jagg_pipeline.io.manifest import section_digests

    manifest = {
        "stage": fields.pop("stage"),
        "version": "0.1.0",
        "config_digest": digest(config),
        "sections": section_digests(config),
        "seeds": {},
        "inputs": fields.pop("inputs", {}),
        "files": files,
    }
    (output / "manifest.json").write_text(json.dumps(manifest))


def test_old_sha256_manifests_verify_and_a_flipped_byte_is_refused_naming_the_file(tmp_path):
    rollout = tmp_path / "rollout"
    # "a.b" sorts before "a/b" as a string, after it as a path: the old digest's order is kept.
    for name, data in [("a.b", b"x"), ("a/b", b"y"), ("shard-0.safetensors", b"z" * 100)]:
        (rollout / name).parent.mkdir(parents=True, exist_ok=True)
        (rollout / name).write_bytes(data)
    _old_manifest(rollout, stage="rollout")
    assert digest_path(rollout, "sha256") == _old_folder_digest(rollout)
    scores = tmp_path / "scores"
    scores.mkdir()
    (scores / "scores.parquet").write_bytes(b"table")
    inputs = {"rollouts": {"path": str(rollout), "digest": _old_folder_digest(rollout)}}
    _old_manifest(scores, stage="score", inputs=inputs)

    config = RunConfig()
    check_input(rollout, stage="rollout", config=config)
    made = check_input(scores, stage="score", config=config)
    check_derived_from(scores, made, "rollouts", rollout)  # sha256, as the old manifest is
    shard = rollout / "shard-0.safetensors"
    damage(shard)
    with pytest.raises(ManifestError, match=rf"^{shard}: corrupt or changed .*its sha256"):
        check_input(rollout, stage="rollout", config=config)


@pytest.mark.parametrize("how", ["flipped", "truncated"])
def test_a_damaged_file_of_a_blake3_manifest_is_refused_naming_it(tmp_path, how):
    out = tmp_path / "out"
    write_everything(out)
    write_manifest(out, stage="rollout", config=RunConfig())
    shard = out / "shard-0.safetensors"
    damage(shard, how)
    with pytest.raises(ManifestError, match=rf"^{shard}: corrupt or changed .*its blake3"):
        check_input(out, stage="rollout", config=RunConfig())


def test_verify_files_hashes_only_the_files_named(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a.bin", "b.bin", "sub/c.bin"):
        atomic_write_bytes(out / name, name.encode() * 1000)  # recorded: the manifest reads none
    write_manifest(out, stage="rollout", config=RunConfig())
    manifest = read_manifest(out)
    damage(out / "b.bin")
    reset_hash_counts()
    verify_files(out, manifest, names=["a.bin", "sub/c.bin"])  # a consumer reads its files
    assert reads() == {str((out / n).resolve()): len(n) * 1000 for n in ("a.bin", "sub/c.bin")}
    with pytest.raises(ManifestError, match=rf"^{out / 'b.bin'}: corrupt or changed"):
        verify_files(out, manifest, names=["b.bin"])
    with pytest.raises(ManifestError, match=rf"^{out / 'd.bin'}: not listed in"):
        verify_files(out, manifest, names=["d.bin"])
    with pytest.raises(ManifestError, match=rf"^{out / 'b.bin'}: corrupt or changed"):
        verify_files(out, manifest)  # all of them


def test_the_digest_of_a_folder_in_a_finished_output_is_read_from_its_manifest(tmp_path):
    written = tmp_path / "written"
    write_everything(written)
    write_manifest(written, stage="train", config=RunConfig())
    ckpt = tmp_path / "ckpt"
    shutil.copytree(written, ckpt)  # new inodes: nothing of it recorded in this process
    reset_hash_counts()
    policy = digest_path(ckpt / "policy")
    whole = digest_path(ckpt)
    table = digest_path(ckpt / "scores.parquet")
    assert reads() == {}
    # What hashing the files gives: blake3 of names and digests, in path order.
    h = blake3()
    for name in (".metadata", "__0_0.distcp"):
        h.update(f"{name}\0{b3(ckpt / 'policy' / name)}\n".encode())
    assert policy == h.hexdigest()
    assert table == b3(ckpt / "scores.parquet")
    assert file_digest(ckpt / "scores.parquet") == table  # the listed digest is the truth
    # Where the manifest does not describe a folder (a file more), its files are hashed.
    (ckpt / "policy" / "extra").write_bytes(b"planted")
    reset_hash_counts()
    assert digest_path(ckpt / "policy") != policy
    hashed = {
        str((ckpt / "policy" / name).resolve()) for name in (".metadata", "__0_0.distcp", "extra")
    }
    assert set(reads()) == hashed
    assert digest_path(ckpt) != whole


def test_two_ranks_write_a_checkpoint_whose_manifest_reads_no_shard_back(tmp_path):
    """write_checkpoint under torchrun on 2 gloo ranks: every shard listed with its digest,
    no rank hashed a byte by reading."""
    worker = tmp_path / "worker.py"
    worker.write_text(
        textwrap.dedent(
            """
            import json, sys
            from pathlib import Path
            import torch
            from torch.distributed.tensor import Shard, distribute_tensor
            from jagg_pipeline.config.run import RunConfig
            from jagg_pipeline.io.manifest import hash_counts, reset_hash_counts
            from jagg_pipeline.stages import checkpoint as ckpt
            from jagg_pipeline.stages.distributed import distributed

            out = Path(sys.argv[1])
            with distributed("cpu") as ctx:
                torch.manual_seed(0)
                w = distribute_tensor(torch.randn(8, 4), ctx.mesh, [Shard(0)])
                m = distribute_tensor(torch.randn(8, 4), ctx.mesh, [Shard(0)])
                contents = ckpt.CheckpointContents(
                    model_state={"w": w},
                    optimizer_state={
                        "state": {"w": {"exp_avg": m, "step": torch.tensor(1.0)}},
                        "param_groups": [{"lr": 0.1, "params": ["w"]}],
                    },
                    rng_state=torch.Generator().get_state(),
                    trainer=ckpt.TrainerState(
                        round=0, global_step=1, skipped_steps=0, scheduler={}, world_size=2
                    ),
                )
                reset_hash_counts()
                ckpt.write_checkpoint(
                    out / "ckpt", contents, config=RunConfig(), seeds={}, inputs={}, extra={}
                )
                counts = hash_counts()
                (out / f"counts-{ctx.rank}.json").write_text(json.dumps(counts))
            """
        )
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [*command, str(worker), str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    files = read_manifest(ckpt)["files"]
    shard_files = {
        f"{folder}/{name}"
        for folder in ("policy", "trainer/optimizer")
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp")
    }
    assert shard_files <= set(files)
    assert set(files) == shard_files | {
        "config.yaml",
        "trainer/state.json",
        "trainer/rng.safetensors",
    }
    for name, digest in files.items():
        assert digest == b3(ckpt / name), name
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"counts-{rank}.json").read_text())
        assert counts["read"] == {"files": 0, "bytes": 0, "paths": {}}, rank
        assert counts["written"]["files"] >= 2  # its shards of the weights and the moments
    check_input(ckpt, stage="train", config=RunConfig())


def test_the_stages_of_a_round_read_none_of_their_own_outputs_back(tiny_sd3, tmp_path):
    """Rollout, score, train (its checkpoint) and a rollout from that checkpoint: each
    stage's manifest lists its files' digests, and what the stage hashed by reading lies
    in its inputs only."""
    from jagg_pipeline.stages.rollout import run_rollout
    from jagg_pipeline.stages.scoring import run_score
    from jagg_pipeline.stages.train import train_round

    def hashed_under() -> set[str]:
        """The output folders (tmp_path's children) of the files hashed by reading."""
        root = tmp_path.resolve()
        return {Path(path).relative_to(root).parts[0] for path in reads()}

    config = make_config(tiny_sd3)
    rollouts, scores = tmp_path / "rollout", tmp_path / "scores"
    reset_hash_counts()
    run_rollout(config, "base", "toy:train", rollouts, progress=False)
    assert hashed_under() == set()
    run_score(config, rollouts, scores)
    assert hashed_under() <= {"rollout"}
    reset_hash_counts()
    checkpoint = train_round(
        config, "base", rollouts, scores, tmp_path / "ckpt", progress=False
    ).checkpoint
    assert hashed_under() <= {"rollout", "scores"}
    reset_hash_counts()
    run_rollout(config, checkpoint, "toy:train", tmp_path / "next", progress=False)
    assert hashed_under() <= {"ckpt"}
    for output in (rollouts, scores, checkpoint, tmp_path / "next"):
        for name, digest in read_manifest(output)["files"].items():
            assert digest == b3(output / name), output / name
    inputs = read_manifest(tmp_path / "next")["inputs"]
    assert inputs["policy"]["digest"] == digest_path(checkpoint / "policy")
    check_input(tmp_path / "next", stage="rollout", config=config)
