"""The rollout, score and evaluate stages on tiny Flux / SD3 / QwenImage checkpoints.

Each stage runs as the CLI runs it (``main([...])``) on checkpoints built offline in the real
diffusers formats; the artifacts are read back from disk only.
"""

import dataclasses
import json

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from stage_helpers import tiny_checkpoint, write_experiment, write_prompts

from jagg_pipeline.cli import main
from jagg_pipeline.config.fields import digest, from_dict
from jagg_pipeline.core.grpo import group_advantages
from jagg_pipeline.core.objective import recompute_log_probs
from jagg_pipeline.io.manifest import (
    ManifestError,
    check_derived_from,
    check_input,
    read_manifest,
    write_manifest,
)
from jagg_pipeline.io.prompts import draw_prompts, resolve_prompts
from jagg_pipeline.io.trajectories import TrajectoryBatch, load_rollout
from jagg_pipeline.rewards import to_unit_float
from jagg_pipeline.rewards.jpeg import jpeg_compressibility
from jagg_pipeline.stages import policy as policies
from jagg_pipeline.stages.rollout import micro_batches, plan_rollout, run_rollout, step_coefficients


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("checkpoints")
    return {family: tiny_checkpoint(family, base) for family in ("flux", "sd3", "qwenimage")}


def rollout_cli(config, out, policy="base", *extra):
    argv = ["rollout", "--config", str(config), "--policy", str(policy)]
    return main([*argv, "--prompts", "toy:train", "--out", str(out), *extra])


# --------------------------------------------------------------------------------------------
# Plans: prompts, seeds, masks, micro-batches
# --------------------------------------------------------------------------------------------


def test_prompt_sources_and_round_draws(tmp_path):
    train, heldout = resolve_prompts("toy:train"), resolve_prompts("toy:heldout")
    assert (len(train), len(heldout)) == (231, 39) and not set(train) & set(heldout)
    (tmp_path / "p.txt").write_text("one\ntwo\n")
    assert resolve_prompts(tmp_path / "p.txt") == ["one", "two"]
    with pytest.raises(ValueError, match="unknown toy prompt set"):
        resolve_prompts("toy:test")

    drawn = draw_prompts(train, 8, seed=3)
    assert drawn == draw_prompts(train, 8, seed=3) != draw_prompts(train, 8, seed=4)
    assert len(set(drawn)) == 8  # without replacement
    assert sorted(draw_prompts(["a", "b", "c"], 6, seed=0)) == ["a", "a", "b", "b", "c", "c"]


def test_rollout_plan_seeds_masks_and_micro_batches(tmp_path, checkpoints):
    _, config = write_experiment(tmp_path / "c.yaml", "flux", checkpoints["flux"])
    pool = resolve_prompts("toy:train")
    plan = plan_rollout(config, pool, round_index=0)
    again = plan_rollout(config, pool, round_index=0)
    assert plan.prompts == again.prompts and torch.equal(plan.seeds, again.seeds)
    assert len(plan.prompts) == 3 and plan.prompt_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert len(set(plan.seeds.tolist())) == 6  # one seed per sample
    assert plan.micro_batches == [range(0, 2), range(2, 4), range(4, 6)]
    assert plan.share(0, 2) == [range(0, 2), range(4, 6)] and plan.share(1, 2) == [range(2, 4)]

    later = [plan_rollout(config, pool, round_index=r) for r in range(1, 6)]
    assert all(not set(p.seeds.tolist()) & set(plan.seeds.tolist()) for p in later)
    starts = {int(p.masks.sde.nonzero()[0]) for p in [plan, *later]}
    assert starts == {0, 1}  # the window moves with the round, within segment_start
    for p in [plan, *later]:
        assert int(p.masks.sde.sum()) == 2 and torch.equal(p.masks.train, p.masks.sde)

    full = from_dict(
        type(config), {"sampler": {"trajectory": "full", "trained_fraction": 0.5}}, base=config
    )
    masks = plan_rollout(full, pool).masks
    assert bool(masks.sde.all()) and int(masks.train.sum()) == 2 and not masks.train[-1]

    assert micro_batches(5, 4, 9) == [range(0, 8), range(8, 16), range(16, 20)]
    assert micro_batches(2, 4, 1) == [range(0, 4), range(4, 8)]  # at least one whole group


def test_a_rollout_stores_velocities_only_where_training_can_reuse_them(tmp_path, checkpoints):
    """Every trained step of 12 (full SDE trajectory) in windows of W: the approximated
    windows with interiors carry velocities, in the compute dtype; nothing where no reuse is
    possible."""
    _, base = write_experiment(tmp_path / "c.yaml", "flux", checkpoints["flux"])
    pool = resolve_prompts("toy:train")
    sampler = {"trajectory": "full", "num_steps": 13, "trained_fraction": 1.0}

    def plan(**sections):
        config = from_dict(type(base), {"sampler": sampler, **sections}, base=base)
        return plan_rollout(config, pool)

    assert plan(jagg={"window": 4}).velocity_steps == list(range(12))
    assert plan(jagg={"window": 4, "jagg_frac": 0.5}).velocity_steps == list(range(8))
    assert plan(jagg={"window": 5}).velocity_steps == list(range(10))  # 10-11: no interior
    for nothing in (
        {"mode": "exact"},
        {"window": 2},
        {"jagg_frac": 0.0},
        {"mode": "no_interp", "no_interp": "drop"},
        {"reuse_velocities": False},
    ):
        assert plan(jagg={"window": 4, **nothing}).velocity_steps == [], nothing
    assert plan(jagg={"window": 4, "jagg_frac": "auto"}).velocity_steps == list(range(12))
    mixed = plan(backbone={"dtype": "float32", "mixed_precision": "bf16"})
    assert mixed.velocity_dtype == torch.bfloat16
    assert plan(backbone={"dtype": "float32"}).velocity_dtype == torch.float32


def test_load_rollout_restores_sample_order_and_refuses_gaps(tmp_path):
    def part(ids):
        ids = torch.tensor(ids)
        n = len(ids)
        return TrajectoryBatch(
            latents=ids.view(n, 1, 1).expand(n, 3, 2).float(),
            log_probs=torch.zeros(n, 2),
            sigmas=torch.tensor([1.0, 0.5, 0.0]),
            sde_mask=torch.tensor([True, False]),
            train_mask=torch.tensor([True, False]),
            prompt_ids=ids // 2,
            group_ids=ids // 2,
            seeds=ids + 100,
            prompts=["a", "b", "c"],
            sample_ids=ids,
        )

    part([0, 1, 4, 5]).save(tmp_path, rank=0)
    part([2, 3]).save(tmp_path, rank=1)
    loaded = load_rollout(tmp_path)
    assert loaded.sample_ids.tolist() == list(range(6))
    assert loaded.seeds.tolist() == [100, 101, 102, 103, 104, 105]
    part([2, 2]).save(tmp_path, rank=1)
    with pytest.raises(ValueError, match=r"sample_ids are not 0\.\.5"):
        load_rollout(tmp_path)


# --------------------------------------------------------------------------------------------
# The stages from the command line
# --------------------------------------------------------------------------------------------


def test_rollout_score_evaluate_from_the_cli(tmp_path, checkpoints, capsys):
    config_file, config = write_experiment(tmp_path / "c.yaml", "flux", checkpoints["flux"])
    rollouts, scores, evals = tmp_path / "rollouts", tmp_path / "scores", tmp_path / "eval"
    rollouts.mkdir()
    (rollouts / "shard-7.safetensors").write_bytes(b"stale")  # a previous, wider run's shard
    rollout_cli(config_file, rollouts)

    assert sorted(p.name for p in rollouts.iterdir()) == [
        "config.yaml",
        "manifest.json",
        "metrics.jsonl",
        "shard-0.json",
        "shard-0.safetensors",
    ]
    (line,) = (rollouts / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["stage"] == "rollout" and json.loads(line)["samples"] == 6
    assert digest(yaml.safe_load((rollouts / "config.yaml").read_text())) == digest(config)
    manifest = check_input(rollouts, stage="rollout", config=config, sections=["sampler"])
    assert manifest["seeds"] == {"train": 0, "round": 0} and manifest["samples"] == 6
    batch = load_rollout(rollouts)
    assert batch.latents.shape[:2] == (6, 5) and batch.log_probs.shape == (6, 4)
    assert batch.images.dtype == torch.uint8 and batch.images.shape == (6, 3, 32, 32)
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2] and len(batch.prompts) == 3
    assert len(set(batch.seeds.tolist())) == 6
    assert manifest["trained_steps"] == batch.trained_steps
    sde_steps = batch.sde_mask.nonzero().flatten().tolist()
    assert (batch.log_probs[:, sde_steps] != 0).all() and (batch.log_probs.sum(0) != 0).sum() == 2
    assert set(batch.cond) == {"prompt_embeds", "pooled_prompt_embeds"}

    score = ["score", "--config", str(config_file), "--rollouts", str(rollouts)]
    main([*score, "--out", str(scores)])
    assert "6 samples (3 groups" in capsys.readouterr().out
    table = pq.read_table(scores / "scores.parquet")
    assert table.column_names == [
        "sample",
        "prompt_id",
        "group",
        "jpeg_compressibility",
        "total",
        "advantage",
        "group_mean",
        "group_std",
    ]
    rows = table.to_pylist()
    assert [r["sample"] for r in rows] == list(range(6))
    expected = jpeg_compressibility(95, to_unit_float(batch.images), batch.prompts)
    assert [r["jpeg_compressibility"] for r in rows] == pytest.approx(expected.tolist())
    stats = group_advantages(expected, batch.group_ids, eps=config.advantage.eps, clip=5.0)
    assert [r["advantage"] for r in rows] == pytest.approx(stats.values.tolist(), abs=1e-6)
    assert [r["group_std"] for r in rows] == pytest.approx(stats.group_std.tolist(), abs=1e-6)
    assert sorted(p.name for p in scores.iterdir()) == [
        "config.yaml",
        "manifest.json",
        "metrics.jsonl",
        "scores.parquet",
        "summary.json",
    ]
    summary = json.loads((scores / "summary.json").read_text())
    assert summary["samples"] == 6 and summary["zero_std_groups"] == 0
    assert summary["reward_means"]["jpeg_compressibility"] == pytest.approx(float(expected.mean()))
    (line,) = (scores / "metrics.jsonl").read_text().splitlines()
    record = json.loads(line)
    # Run in-process, not as a command: its load and work seconds, no import (startup.py).
    assert record.pop("time.load") > 0 and record.pop("time.work") > 0
    assert record == {
        "stage": "score",
        "round": 0,
        "step": 0,
        "total_mean": pytest.approx(summary["total_mean"]),
        "total_std": pytest.approx(summary["total_std"]),
        "zero_std_groups": 0,
        "reward_jpeg_compressibility": pytest.approx(summary["total_mean"]),
    }
    score_manifest = check_input(scores, stage="score", config=config)
    check_derived_from(scores, score_manifest, "rollouts", rollouts)
    # --set overrides a config key as in every command; the resolved config records it.
    lower = tmp_path / "q50"
    main([*score, "--out", str(lower), "--set", "rewards.jpeg_compressibility.quality=50"])
    resolved = yaml.safe_load((lower / "config.yaml").read_text())
    assert resolved["rewards"]["jpeg_compressibility"] == {"quality": 50}
    q50 = pq.read_table(lower / "scores.parquet").column("jpeg_compressibility").to_pylist()
    assert all(a > b for a, b in zip(q50, expected.tolist(), strict=True))  # smaller files

    reports = []
    evaluate = ["evaluate", "--config", str(config_file), "--policy", "base"]
    for run in ("a", "b"):
        main([*evaluate, "--out", str(evals / run)])
        reports.append((evals / run / "metrics.json").read_text())
    assert reports[0] == reports[1]  # deterministic: the same policy gives the same metrics
    first, second = evals / "a", evals / "b"
    for name in [
        "grid.png",
        "samples.jsonl",
        *(f"images/000{p}_0{s}.png" for p in "01" for s in "01"),
    ]:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    report = json.loads(reports[0])
    assert report["num_prompts"] == 2 and report["samples_per_prompt"] == 2
    assert len(report["per_prompt"]) == 2 and report["per_prompt"][1]["prompt"].startswith("a blue")
    metric = report["metrics"]["jpeg_compressibility"]
    lines = (first / "samples.jsonl").read_text().splitlines()
    per_image = [json.loads(line)["jpeg_compressibility"] for line in lines]
    assert metric["mean"] == pytest.approx(sum(per_image) / 4) and metric["std"] > 0
    assert read_manifest(first)["stage"] == "evaluate"
    (line,) = (first / "metrics.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record.pop("time.load") > 0 and record.pop("time.work") > 0
    assert record == {
        "stage": "evaluate",
        "round": 0,
        "step": 0,
        "jpeg_compressibility": metric["mean"],
        "jpeg_compressibility_std": metric["std"],
    }
    assert "prompts" in read_manifest(first)["inputs"]  # the eval prompt file's digest


@pytest.mark.parametrize(
    ("family", "sections"),
    [
        ("flux", {}),
        ("sd3", {"sampler": {"trajectory": "full", "step": "dance_grpo", "noise_level": 0.3}}),
        ("qwenimage", {"backbone": {"cfg_scale": 2.0}}),  # variable-length text, negatives
    ],
)
def test_rollout_log_probs_recompute_on_the_training_path_with_ratio_one(
    tmp_path, checkpoints, family, sections
):
    _, config = write_experiment(tmp_path / "c.yaml", family, checkpoints[family], **sections)
    prompts = write_prompts(tmp_path / "prompts.txt")  # of different token counts
    run_rollout(config, "base", prompts, tmp_path / "r", progress=False)
    batch = load_rollout(tmp_path / "r")
    steps = batch.trained_steps
    assert steps and (batch.log_probs[:, steps] != 0).all()
    policy = policies.load_policy(config, "base")
    coeffs = step_coefficients(config.sampler)
    ranges = read_manifest(tmp_path / "r")["micro_batches"]
    for start, stop in ranges:  # the rollout's batch composition, as training must use
        part = batch.select(list(range(start, stop)))
        recomputed = recompute_log_probs(
            policy.velocity, part.latents, part.sigmas, part.cond, steps, coeffs
        )
        assert torch.equal(recomputed, part.log_probs[:, steps])  # ratio == 1 exactly


def test_a_sample_depends_on_its_seed_not_on_its_micro_batch(tmp_path, checkpoints):
    rollouts = {}
    for batch_size in (2, 6):
        _, config = write_experiment(
            tmp_path / "c.yaml", "flux", checkpoints["flux"], sampler={"batch_size": batch_size}
        )
        run_rollout(config, "base", "toy:train", tmp_path / str(batch_size), progress=False)
        rollouts[batch_size] = load_rollout(tmp_path / str(batch_size))
    small, large = rollouts[2], rollouts[6]
    assert torch.equal(small.seeds, large.seeds)
    assert torch.equal(small.latents[:, 0], large.latents[:, 0])  # the same initial noise
    # ... and the same SDE noise: only float rounding of the batched forwards differs.
    torch.testing.assert_close(small.latents, large.latents, rtol=1e-4, atol=1e-4)
    assert (small.latents[:, -1] - small.latents[:, 0]).abs().max() > 0.5


# --------------------------------------------------------------------------------------------
# Policies: checkpoint directories
# --------------------------------------------------------------------------------------------


def perturb(backbone, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in backbone.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def probe(backbone):
    cond = backbone.encode_prompts(["a red circle on the left, white background"])
    z = backbone.initial_noise(1, torch.Generator().manual_seed(0))
    return backbone.velocity(z, torch.tensor([0.6]), cond)


@pytest.mark.parametrize("training", ["full", "lora"])
def test_checkpoints_round_trip_and_drive_rollout_and_evaluate(tmp_path, checkpoints, training):
    sections = {"backbone": {"training": training, "lora": {"rank": 2}}}
    config_file, config = write_experiment(
        tmp_path / "c.yaml", "sd3", checkpoints["sd3"], **sections
    )
    trained = policies.load_policy(config, "base")
    base_v = probe(trained)
    perturb(trained)
    checkpoint = tmp_path / "ckpt"
    policies.save_policy(trained, checkpoint)
    policies.save_policy(trained, checkpoint)  # replacing a policy leaves nothing behind
    assert sorted(p.name for p in (checkpoint / "policy").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
    ]
    assert [p.name for p in checkpoint.iterdir()] == ["policy"]
    write_manifest(checkpoint, stage="train", config=config)

    loaded = policies.load_policy(config, checkpoint)
    assert torch.equal(probe(loaded), probe(trained)) and not torch.allclose(probe(loaded), base_v)

    rollout_cli(config_file, tmp_path / "r", checkpoint)
    inputs = read_manifest(tmp_path / "r")["inputs"]
    assert inputs["policy"]["path"] == str(checkpoint / "policy")
    evaluate = ["evaluate", "--config", str(config_file), "--policy", str(checkpoint)]
    main([*evaluate, "--out", str(tmp_path / "e")])
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["policy"] == str(checkpoint)


@pytest.mark.parametrize("training", ["full", "lora"])
def test_export_writes_the_hub_format_of_a_checkpoint(tmp_path, checkpoints, training):
    """Full fine-tuning: a diffusers folder that loads as backbone.path; LoRA: a peft adapter
    that loads onto the base model. Both give the checkpoint's velocities exactly."""
    sections = {"backbone": {"training": training, "lora": {"rank": 2}}}
    config_file, config = write_experiment(
        tmp_path / "c.yaml", "sd3", checkpoints["sd3"], **sections
    )
    trained = policies.load_policy(config, "base")
    perturb(trained)
    checkpoint = tmp_path / "ckpt"
    policies.save_policy(trained, checkpoint)
    write_manifest(checkpoint, stage="train", config=config)
    out = tmp_path / "export"
    main(["export", "--config", str(config_file), "--policy", str(checkpoint), "--out", str(out)])
    if training == "lora":
        assert sorted(p.name for p in out.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "manifest.json",  # which the loaders ignore
            "pytorch_lora_weights.safetensors",
        ]
        exported = policies.load_policy(config, "base")
        exported.load_lora(out)
    else:
        assert (out / "model_index.json").is_file() and (out / "transformer").is_dir()
        moved = dataclasses.replace(config.backbone, path=str(out))
        exported = policies.load_policy(dataclasses.replace(config, backbone=moved), "base")
    assert torch.equal(probe(exported), probe(trained))


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------


def test_stages_refuse_inputs_that_do_not_match_naming_the_file(tmp_path, checkpoints):
    config_file, _ = write_experiment(tmp_path / "c.yaml", "flux", checkpoints["flux"])
    rollouts = tmp_path / "r"
    rollout_cli(config_file, rollouts)
    other_file, _ = write_experiment(
        tmp_path / "other.yaml", "flux", checkpoints["flux"], sampler={"num_steps": 5}
    )
    score = ["score", "--rollouts", str(rollouts), "--out", str(tmp_path / "s.parquet")]
    with pytest.raises(
        SystemExit, match=rf"{rollouts}: was made with a different config section sampler"
    ):
        main([*score, "--config", str(other_file)])
    with pytest.raises(SystemExit):  # the rewards come from the config: no --reward here
        main([*score, "--config", str(config_file), "--reward", "jpeg_compressibility"])
    with pytest.raises(SystemExit):  # --config is required
        main(score)
    not_rollout = tmp_path / "e"
    main(["evaluate", "--config", str(config_file), "--policy", "base", "--out", str(not_rollout)])
    with pytest.raises(
        SystemExit, match=rf"{not_rollout}: is a 'evaluate' output, expected rollout"
    ):
        main(
            [
                "score",
                "--rollouts",
                str(not_rollout),
                "--config",
                str(config_file),
                "--out",
                str(tmp_path / "x.parquet"),
            ]
        )
    assert not (tmp_path / "s.parquet").exists() and not (tmp_path / "x.parquet").exists()

    # A checkpoint trained under another backbone section (here: CFG) is refused.
    checkpoint = tmp_path / "ckpt"
    _, cfg_config = write_experiment(
        tmp_path / "cfg.yaml", "flux", checkpoints["flux"], backbone={"cfg_scale": 2.0}
    )
    policies.save_policy(policies.load_policy(cfg_config, "base"), checkpoint)
    write_manifest(checkpoint, stage="train", config=cfg_config)
    evaluate = ["evaluate", "--config", str(config_file), "--policy", str(checkpoint)]
    with pytest.raises(
        SystemExit, match=rf"{checkpoint}: was made with a different config section backbone"
    ):
        main([*evaluate, "--out", str(tmp_path / "e2")])
    with pytest.raises(SystemExit, match=rf"{rollouts}: is a 'rollout' output, expected train"):
        main(
            [
                "evaluate",
                "--config",
                str(config_file),
                "--policy",
                str(rollouts),
                "--out",
                str(tmp_path / "e3"),
            ]
        )
    with pytest.raises(SystemExit, match="neither 'base' nor a checkpoint directory"):
        rollout_cli(config_file, tmp_path / "r2", tmp_path / "missing")
    weights = checkpoint / "policy" / "__0_0.distcp"
    weights.unlink()
    with pytest.raises(ManifestError, match=rf"^{weights}: missing, though .*manifest\.json"):
        policies.load_policy(cfg_config, checkpoint)
    backbone = policies.load_policy(cfg_config, "base")
    with pytest.raises(policies.PolicyError, match=r"policy: holds no saved weights"):
        policies.apply_policy(backbone, tmp_path / "r" / "policy")
    lora = policies.load_policy(
        dataclasses.replace(
            cfg_config, backbone=dataclasses.replace(cfg_config.backbone, training="lora")
        ),
        "base",
    )
    policies.save_policy(lora, tmp_path / "lora")
    with pytest.raises(policies.PolicyError, match=r"do not fit .* unexpected \['.*lora_A"):
        policies.apply_policy(backbone, tmp_path / "lora" / "policy")
    with pytest.raises(
        SystemExit, match=r"--set sampler\.num_stepz=3: sampler\.num_stepz: unknown key"
    ):
        rollout_cli(other_file, tmp_path / "r3", "base", "--set", "sampler.num_stepz=3")
