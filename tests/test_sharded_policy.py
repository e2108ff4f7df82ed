"""Loads sized to the shard: today's weights bit for bit, and only what a rank reads is hashed.

``load_sharded_policy`` builds the transformer on the meta device, shards it and reads each
rank's rows; the reference is the path it replaces: ``load_policy`` of the whole model,
``shard_backbone``, then the checkpoint's ``policy/`` read into the shards as the train stage's
``_resume`` did. Compared bit for bit (dtype included): every local parameter shard, buffer
and plain tensor attribute (QwenImage's rotary tables), the VAE and text encoders, and a
velocity, on the tiny real-format Flux, SD3 and QwenImage checkpoints, full fine-tuning and
LoRA, base and a trained checkpoint written by two ranks, in a world of one and under
torchrun with 2 gloo ranks. Verification: a corrupt file a load reads is refused
naming it; a sampling load hashes no optimizer file; a resumed train rank hashes only files
it reads, and on one host each file is hashed once in total (manifest.hash_counts).

Run as a script it is the torchrun worker: ``python test_sharded_policy.py equal ROOT OUT``
(the bit-for-bit comparison) or ``python test_sharded_policy.py train CONFIG POLICY ROLLOUTS
SCORES CKPT OUT`` (a train round, each rank writing what it hashed to ``OUT.<rank>.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import train_helpers
from train_helpers import (
    flip_byte,
    launcher,
    make_config,
    run_train_command,
    subprocess_env,
    write_config,
)

# (family, training, dtype, mixed precision): every family in both modes, plus a load that
# converts the float32 files to bfloat16 slice by slice, and a bf16 mixed-precision policy.
CASES = [
    *(
        (family, mode, "float32", "no")
        for family in ("flux", "sd3", "qwenimage")
        for mode in ("full", "lora")
    ),
    ("flux", "lora", "bfloat16", "no"),
    ("qwenimage", "full", "float32", "bf16"),
]
PROMPTS = ["a red circle on the left, white background", "a blue square at the top"]


# --------------------------------------------------------------------------------------------
# The torchrun worker: bit for bit against today's path
# --------------------------------------------------------------------------------------------


def _config(root: Path, family: str, mode: str, dtype: str, mixed: str) -> Any:
    from jagg_pipeline.config.run import from_mapping

    backbone = {
        "family": family,
        "path": str(root / family),
        "height": 32,
        "width": 32,
        "dtype": dtype,
        "mixed_precision": mixed,
        "training": mode,
        "max_sequence_length": 16,
        "lora": {"rank": 2},
    }
    return from_mapping({"backbone": backbone, "tracking": {"backend": "none"}})


def _write_checkpoint(config: Any, ctx: Any, target: Path) -> None:
    """A trained-looking checkpoint: the base's trainable weights plus seeded noise, sharded
    as this world's ranks hold them, with a finished ``train`` manifest (a collective)."""
    from jagg_pipeline.io import shards
    from jagg_pipeline.io.manifest import finish_output
    from jagg_pipeline.stages import distributed
    from jagg_pipeline.stages.policy import load_sharded_policy

    backbone = load_sharded_policy(config, "base", ctx, for_training=True)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, param in sorted(backbone.transformer.named_parameters()):
            if param.requires_grad:
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
                local, rows = distributed.local_rows(param)
                local.add_((noise if rows is None else noise[rows]).to(local.dtype) * 0.05)
    if ctx.is_main:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
    distributed.barrier()
    shards.save(distributed.model_state_dict(backbone.transformer), target / "policy")
    distributed.barrier()
    if ctx.is_main:
        finish_output(target, config, stage="train")
    distributed.barrier()


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a module computes with: local parameter shards, buffers, tensor attributes."""
    from jagg_pipeline.io.shards import local_tensor

    found = {f"param {n}": local_tensor(p).detach() for n, p in module.named_parameters()}
    found.update({f"buffer {n}": b for n, b in module.named_buffers()})
    for name, sub in module.named_modules():
        for key, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                found[f"attribute {name}.{key}"] = value
    return found


def _modules(backbone: Any) -> dict[str, torch.nn.Module]:
    modules = {"transformer": backbone.transformer, "vae": backbone.vae}
    modules.update({k: v for k, v in backbone.text.items() if isinstance(v, torch.nn.Module)})
    return modules


def _differences(old: Any, new: Any) -> list[str]:
    """What differs between two backbones: values, dtypes, devices, trainability, components."""
    ours, theirs = _modules(old), _modules(new)
    if ours.keys() != theirs.keys():
        return [f"components {sorted(ours)} vs {sorted(theirs)}"]
    problems = []
    for component, module in ours.items():
        a, b = _tensors(module), _tensors(theirs[component])
        if a.keys() != b.keys():
            problems.append(f"{component}: names differ {sorted(set(a) ^ set(b))[:4]}")
            continue
        problems += [
            f"{component}: {name}"
            for name in a
            if (a[name].dtype, a[name].device) != (b[name].dtype, b[name].device)
            or not torch.equal(a[name], b[name])
        ]
    grads = {n: p.requires_grad for n, p in old.transformer.named_parameters()}
    problems += [
        f"requires_grad {n}"
        for n, p in new.transformer.named_parameters()
        if p.requires_grad != grads[n]
    ]
    return problems


def _velocity(backbone: Any, cond: dict[str, torch.Tensor]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    z = torch.randn(len(PROMPTS), *backbone.latent_shape, generator=generator)
    sigma = torch.full((len(PROMPTS),), 0.7)
    with torch.no_grad():
        return backbone.velocity(z.to(backbone.dtype), sigma, cond)


def _compare(config: Any, policy: str | Path, ctx: Any) -> list[str]:
    """Today's path against the sharded load, for training and for sampling."""
    from jagg_pipeline.stages import distributed
    from jagg_pipeline.stages.policy import load_policy, load_sharded_policy, load_weights

    mixed = config.backbone.mixed_precision == "bf16"
    problems = []
    # Training: the base loaded whole, sharded, then _resume's read of policy/.
    old = load_policy(config, "base", ctx.device, for_training=True)
    distributed.shard_backbone(old, ctx, mixed_precision=mixed)
    if str(policy) != "base":
        weights = distributed.model_state_dict(old.transformer)
        load_weights(weights, Path(policy) / "policy", collective=True)
        distributed.load_model_state_dict(old.transformer, weights)
    new = load_sharded_policy(config, policy, ctx, for_training=True)
    problems += [f"training: {p}" for p in _differences(old, new)]
    if config.backbone.training == "lora":  # the KL reference: adapters in place, frozen
        frozen = load_sharded_policy(config, policy, ctx, for_training=True, frozen=True)
        problems += [f"frozen: {p}" for p in _differences(old, frozen) if "grad" not in p]
        if any(p.requires_grad for p in frozen.transformer.parameters()):
            problems.append("frozen: a parameter takes a gradient")
    # Sampling: the policy loaded whole (text encoders too), then sharded as training is.
    old = _whole(config, policy, ctx.device)
    distributed.shard_backbone(old, ctx, mixed_precision=mixed)
    new = load_sharded_policy(config, policy, ctx)
    problems += [f"sampling: {p}" for p in _differences(old, new)]
    cond = old.encode_prompts(PROMPTS)
    if not torch.equal(_velocity(old, cond), _velocity(new, cond)):
        problems.append("sampling: the velocities differ")
    return problems


def _whole(config: Any, policy: str | Path, device: torch.device) -> Any:
    """The policy loaded whole, text encoders too; under bf16 mixed precision without the
    cast to bf16 of ``load_policy``, as FSDP2's policy casts (what the sharded one does)."""
    import dataclasses

    from jagg_pipeline.backbones import load_backbone
    from jagg_pipeline.stages.policy import apply_policy, load_policy

    if config.backbone.mixed_precision == "no":
        return load_policy(config, policy, device)
    backbone = load_backbone(dataclasses.replace(config.backbone, device=str(device)))
    if str(policy) != "base":
        apply_policy(backbone, Path(policy) / "policy")
    return backbone


def _equal_worker(root: Path, out: Path) -> None:
    from jagg_pipeline.stages import distributed

    torch.set_num_threads(1)
    report: dict[str, list[str]] = {}
    with distributed.distributed("cpu") as ctx:
        for family, mode, dtype, mixed in CASES:
            config = _config(root, family, mode, dtype, mixed)
            name = f"{family}-{mode}-{dtype}-{mixed}"
            checkpoint = root / f"{name}-trained"
            if not checkpoint.exists():  # written by the first run, two ranks
                _write_checkpoint(config, ctx, checkpoint)
            policies = ["base", checkpoint]
            for policy in policies:
                label = f"{name} from {Path(policy).name}"
                report[label] = _compare(config, policy, ctx)
        if ctx.is_main:
            out.write_text(json.dumps(report, indent=1))


# --------------------------------------------------------------------------------------------
# The torchrun worker: what a train rank hashes
# --------------------------------------------------------------------------------------------


def _train_worker(
    config_file: Path, policy: Path, rollouts: Path, scores: Path, ckpt: Path, out: Path
) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystem

    from jagg_pipeline.config.run import load_config
    from jagg_pipeline.io.manifest import ManifestError, hash_counts, reset_hash_counts
    from jagg_pipeline.stages.train import train_round

    torch.set_num_threads(1)
    opened: set[str] = set()  # the sharded-state files DCP reads on this rank (the truth)
    create_stream = FileSystem.create_stream

    def recording(self: FileSystem, path: Any, mode: str) -> Any:
        if "r" in mode:
            opened.add(str(Path(path).resolve()))
        return create_stream(self, path, mode)

    FileSystem.create_stream = recording
    built = _count_model_builds()
    reset_hash_counts()
    error = None
    try:
        train_round(load_config(config_file), policy, rollouts, scores, ckpt, progress=False)
    except ManifestError as err:
        error = str(err)
    report = {
        "hashed": hash_counts()["read"]["paths"],
        "opened": sorted(opened),
        "error": error,
        "models_built": built["calls"],
    }
    Path(f"{out}.{os.environ['RANK']}.json").write_text(json.dumps(report))


def _count_model_builds() -> dict[str, int]:
    """Count, from now on in this process, the backbones the policy loaders build."""
    from jagg_pipeline.stages import policy

    counter = {"calls": 0}
    build = policy.backbone_class

    def counting(family: str) -> Any:
        counter["calls"] += 1
        return build(family)

    policy.backbone_class = counting
    return counter


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> Path:
    from jagg_pipeline.toyworld.tiny import TINY_FAMILIES, save_tiny_pipeline

    root = tmp_path_factory.mktemp("sharded")
    for family in TINY_FAMILIES:
        save_tiny_pipeline(family, root / family)
    return root


@pytest.mark.slow
def test_sharded_loads_equal_todays_path_bit_for_bit_on_one_and_two_ranks(pipelines, tmp_path):
    script = str(Path(__file__).resolve())
    reports = {}
    for nproc in (2, None):  # two ranks first: the one-rank run then reads their checkpoints
        out = tmp_path / f"report-{nproc}.json"
        command = [*launcher(nproc), script, "equal", str(pipelines), str(out)]
        result = subprocess.run(
            command, env=subprocess_env(), capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-4000:]
        reports[nproc] = json.loads(out.read_text())
    # Every case from base and from a checkpoint that two ranks wrote, on two ranks and one.
    assert len(reports[2]) == len(reports[None]) == 2 * len(CASES)
    failures = {f"{n} ranks: {k}": v for n, r in reports.items() for k, v in r.items() if v}
    assert not failures, json.dumps(failures, indent=1)[:4000]


def _read_files(root: Path, folder: str) -> set[str]:
    return {str(p.resolve()) for p in (root / folder).iterdir()}


def test_a_sampling_load_hashes_policy_only_and_refuses_a_corrupt_shard(
    tiny_sd3, base_rollout, tmp_path
):
    from jagg_pipeline.io.manifest import ManifestError, hash_counts, reset_hash_counts
    from jagg_pipeline.stages import distributed
    from jagg_pipeline.stages.policy import load_sharded_policy
    from jagg_pipeline.stages.train import train_round

    config = make_config(tiny_sd3, train={"ema_decay": 0.9})
    rollouts, scores = base_rollout
    checkpoint = train_round(config, "base", rollouts, scores, tmp_path / "ckpt", progress=False)
    checkpoint = checkpoint.checkpoint
    reset_hash_counts()
    with distributed.distributed("cpu") as ctx:
        load_sharded_policy(config, checkpoint, ctx)
    hashed = set(hash_counts()["read"]["paths"])
    assert hashed == _read_files(checkpoint, "policy")  # .metadata and the chunk file
    assert not any("trainer" in path for path in hashed)  # no optimizer, EMA, generator

    shard = next((checkpoint / "policy").glob("*.distcp"))
    flip_byte(shard)
    with (
        distributed.distributed("cpu") as ctx,
        pytest.raises(ManifestError, match=rf"^{shard}: corrupt or changed"),
    ):
        load_sharded_policy(config, checkpoint, ctx)


def _refuse_model_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make building any policy backbone fail loudly: a refusal must come before it."""
    from jagg_pipeline.stages import policy

    def build(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model was loaded before the corrupt file was refused")

    monkeypatch.setattr(policy, "backbone_class", build)
    monkeypatch.setattr(policy, "load_backbone", build)


@pytest.mark.parametrize("damaged", ["optimizer", "ema", "policy", "rng"])
def test_a_resumed_round_refuses_a_corrupt_file_before_loading_a_model(
    damaged, tiny_sd3, base_rollout, tmp_path, monkeypatch
):
    from jagg_pipeline.io.manifest import ManifestError
    from jagg_pipeline.stages.train import train_round

    config = make_config(tiny_sd3, train={"ema_decay": 0.9})
    rollouts, scores = base_rollout
    first = train_round(config, "base", rollouts, scores, tmp_path / "r0", progress=False)
    next_rollouts, next_scores = train_helpers.scored_rollout(
        config, tmp_path / "r1", first.checkpoint, round_index=1
    )
    file = {
        "optimizer": next((first.checkpoint / "trainer" / "optimizer").glob("*.distcp"), None),
        "ema": next((first.checkpoint / "trainer" / "ema").glob("*.distcp"), None),
        "policy": next((first.checkpoint / "policy").glob("*.distcp"), None),
        "rng": first.checkpoint / "trainer" / "rng.safetensors",
    }[damaged]
    flip_byte(file)
    _refuse_model_builds(monkeypatch)
    with pytest.raises(ManifestError, match=rf"^{file}: corrupt or changed"):
        train_round(
            config, first.checkpoint, next_rollouts, next_scores, tmp_path / "r1c", progress=False
        )
    assert not (tmp_path / "r1c").exists()


def test_resuming_with_ema_from_a_checkpoint_without_one_is_refused_before_a_model(
    tiny_sd3, base_rollout, tmp_path, monkeypatch
):
    from jagg_pipeline.stages.train import TrainInputError, train_round

    config = make_config(tiny_sd3)
    rollouts, scores = base_rollout
    first = train_round(config, "base", rollouts, scores, tmp_path / "r0", progress=False)
    next_rollouts, next_scores = train_helpers.scored_rollout(
        config, tmp_path / "r1", first.checkpoint, round_index=1
    )
    _refuse_model_builds(monkeypatch)
    with pytest.raises(TrainInputError, match=r"has no EMA weights, but train.ema_decay is set"):
        train_round(
            make_config(tiny_sd3, train={"ema_decay": 0.9}),
            first.checkpoint,
            next_rollouts,
            next_scores,
            tmp_path / "r1c",
            progress=False,
        )


@pytest.mark.slow
def test_two_train_ranks_hash_only_what_they_read_each_file_once(tiny_sd3, base_rollout, tmp_path):
    """Round 1 on 2 ranks from a 2-rank checkpoint: rank r reads the ``__r_0`` chunks of the
    policy, optimizer and EMA (its rows), both read the rest; nothing else is hashed. Then a
    corrupt optimizer file only rank 1 reads is refused on both ranks before any model."""
    config = make_config(tiny_sd3, train={"ema_decay": 0.9})
    config_file = write_config(config, tmp_path / "config.yaml")
    rollouts, scores = base_rollout
    first = tmp_path / "r0"
    args = ["--config", str(config_file), "--policy", "base", "--rollouts", str(rollouts)]
    run_train_command([*args, "--scores", str(scores), "--out", str(first)], nproc=2)
    next_rollouts, next_scores = train_helpers.scored_rollout(
        config, tmp_path / "r1", first, round_index=1
    )

    def train_on_two_ranks(name: str) -> list[dict[str, Any]]:
        out = tmp_path / name
        command = [
            *launcher(2),
            str(Path(__file__).resolve()),
            "train",
            str(config_file),
            str(first),
            str(next_rollouts),
            str(next_scores),
            str(tmp_path / f"{name}-ckpt"),
            str(out),
        ]
        result = subprocess.run(
            command, env=subprocess_env(), capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-4000:]
        return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]

    reports = train_on_two_ranks("hashed")
    assert [r["error"] for r in reports] == [None, None]
    assert all(r["models_built"] for r in reports)
    inputs = (str(first.resolve()), str(next_rollouts.resolve()), str(next_scores.resolve()))
    # Not the round's own output: what the rank hashed of its inputs.
    hashed = [{p: n for p, n in r["hashed"].items() if p.startswith(inputs)} for r in reports]

    def files(folder: Path, names: list[str]) -> set[str]:
        return {str((folder / name).resolve()) for name in names}

    # What each rank read: every rank reads the trainer state and generator, every rollout
    # shard (each shard's per-sample columns) and the score table; of the sharded state,
    # the files DCP opened on that rank.
    both = files(first / "trainer", ["state.json", "rng.safetensors"])
    both |= files(next_rollouts, ["shard-0.safetensors", "shard-0.json"])
    both |= files(next_scores, ["scores.parquet"])
    read = [both | set(r["opened"]) for r in reports]
    # Rank r's rows of the policy and EMA are in rank r's files only (two ranks wrote them).
    for rank in (0, 1):
        chunks = {p for p in read[rank] if p.endswith(".distcp") and "optimizer" not in p}
        assert chunks == files(
            first, [f"policy/__{rank}_0.distcp", f"trainer/ema/__{rank}_0.distcp"]
        )
    # No rank hashed a file it does not read; on one host each file read is hashed once.
    assert set(hashed[0]) <= read[0] and set(hashed[1]) <= read[1]
    assert set(hashed[0]) | set(hashed[1]) == read[0] | read[1]
    assert not set(hashed[0]) & set(hashed[1])
    assert all(entry["times"] == 1 for h in hashed for entry in h.values())
    assert hashed[0] and hashed[1]  # the work was shared

    # A flipped byte in rank 1's optimizer rows: both ranks refuse it, naming the file,
    # before either builds a model.
    damaged = first / "trainer" / "optimizer" / "__1_0.distcp"
    flip_byte(damaged)
    reports = train_on_two_ranks("damaged")
    for report in reports:
        assert report["error"].startswith(f"{damaged}: corrupt or changed"), report["error"]
        assert report["models_built"] == 0


def test_files_are_spread_over_the_readers_of_each_host():
    from jagg_pipeline.io.verify import assign

    everyone = [
        ("a", {"big": 100, "small": 1, "mine0": 50}),
        ("a", {"big": 100, "small": 1, "mine1": 60}),
        ("b", {"big": 100, "small": 1}),
    ]
    hashed = assign(everyone)
    assert hashed[2] == {"big", "small"}  # host b's only rank
    host_a = hashed[0] | hashed[1]
    assert host_a == {"big", "small", "mine0", "mine1"} and not hashed[0] & hashed[1]
    # Largest first to the least loaded reader: big -> 0; mine1 -> 1 and mine0 -> 0 (their
    # only readers); small -> 1 (60 bytes so far against 150).
    assert hashed[0] == {"big", "mine0"} and hashed[1] == {"mine1", "small"}


if __name__ == "__main__":
    if sys.argv[1] == "equal":
        _equal_worker(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        _train_worker(*(Path(a) for a in sys.argv[2:8]))
