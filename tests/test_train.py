"""The training stage: gradient modes, routing, loop, non-finite steps, checkpoints, resume.

In-process rounds run under FSDP2 as a world of one (the code path of every world size);
tests/test_distributed.py runs two processes. float64 makes the equalities tight.
"""

import json
import queue
import re
import signal
import subprocess
import threading

import pytest
import torch
import train_helpers
from train_helpers import (
    assert_same_checkpoint,
    launcher,
    make_config,
    max_difference,
    policy_weights,
    scored_rollout,
    subprocess_env,
    write_config,
)

from jagg_pipeline.bench.gradcheck import GradcheckConfig, run_gradcheck
from jagg_pipeline.config.run import lr_factor
from jagg_pipeline.io.artifacts import staging_path
from jagg_pipeline.io.manifest import ManifestError
from jagg_pipeline.io.tables import read_table
from jagg_pipeline.stages import checkpoint as ckpt
from jagg_pipeline.stages import distributed
from jagg_pipeline.stages.checkpoint import NonFiniteError, read_trainer_state
from jagg_pipeline.stages.loop import run_rounds
from jagg_pipeline.stages.scoring import table_path
from jagg_pipeline.stages.train import (
    Routing,
    TrainInputError,
    decide_routing,
    load_round_data,
    plan_steps,
    train_round,
)


def _train(config, rollout, out, policy="base"):
    rollouts, table = rollout
    return train_round(config, policy, rollouts, table, out, progress=False)


# --------------------------------------------------------------------------------------------
# Gradient modes and backward calls
# --------------------------------------------------------------------------------------------


def test_jagg_at_window_2_equals_exact_and_frac_0_is_exact(tiny_sd3, base_rollout, tmp_path):
    """Test 2a: at W = 2 jagg is exact by construction; jagg_frac = 0 routes nothing."""
    runs = {}
    for name, jagg in {
        "exact": {"mode": "exact", "window": 2},
        "jagg": {"mode": "jagg", "window": 2, "jagg_frac": 1.0, "endpoint_backward": "joint"},
        "sequential": {"mode": "jagg", "window": 2, "jagg_frac": 1.0},
        "frac0": {"mode": "jagg", "window": 4, "jagg_frac": 0.0},
    }.items():
        result = _train(make_config(tiny_sd3, jagg=jagg), base_rollout, tmp_path / name)
        runs[name] = (policy_weights(tmp_path / name), result.metrics[0])
    exact, jagg, sequential, frac0 = (runs[n][0] for n in runs)
    # float64: the stacked endpoint forward changes the summation order, nothing else.
    assert max_difference(exact, jagg) <= 1e-15
    assert max_difference(exact, sequential) <= 1e-15
    assert all(torch.equal(exact[k], frac0[k]) for k in exact)  # the same computation
    # 8 trained steps, 2 micro-batches: exact makes 8 backward calls per micro-batch, jagg at
    # W = 2 one per window of 2 (joint endpoint backward), or one per endpoint (sequential).
    assert [runs[n][1]["backward_calls"] for n in runs] == [16, 8, 16, 16]
    # The step's gradient is that of the mean over ALL its samples and trained steps, however
    # they are split into micro-batches and backward calls.
    direct = _mean_objective_gradient(make_config(tiny_sd3), *base_rollout)
    assert runs["exact"][1]["grad_norm"] == pytest.approx(float(direct.norm()), rel=1e-12)


def _mean_objective_gradient(config, rollouts, table):
    """The gradient of the GRPO objective of the whole rollout in one batch, by autograd."""
    from jagg_pipeline.core import jagg
    from jagg_pipeline.core.objective import GRPOStepLoss
    from jagg_pipeline.io.trajectories import load_rollout
    from jagg_pipeline.stages.policy import load_policy
    from jagg_pipeline.stages.rollout import step_coefficients

    batch = load_rollout(rollouts)
    advantages = torch.tensor([row["advantage"] for row in read_table(table_path(table))])
    backbone = load_policy(config, "base")
    objective = GRPOStepLoss(
        batch.latents,
        batch.sigmas,
        batch.log_probs,
        advantages,
        batch.trained_steps,
        step_coefficients(config.sampler),
        config.grpo.clip_range,
        cond=batch.cond,
    )

    def loss():
        total = sum(
            objective(
                backbone.velocity(
                    batch.latents[:, k], batch.sigmas[k].expand(len(batch)), batch.cond
                ),
                k,
            )
            for k in batch.trained_steps
        )
        total.backward()

    return jagg.collect_gradient(backbone.trainable_parameters(), loss)


def test_window_4_counts_4_backward_calls_per_exact_window_2_per_jagg(
    tiny_sd3, base_rollout, tmp_path
):
    """Test 2b: W = 4, jagg_frac = 0.5: the high-noise window is jagg, the other exact."""
    config = make_config(tiny_sd3, jagg={"mode": "jagg", "window": 4, "jagg_frac": 0.5})
    metrics = _train(config, base_rollout, tmp_path / "ckpt").metrics
    (row,) = metrics
    assert row["micro_batches_per_rank"] == 2
    windows = [(w["steps"], w["mode"], w["backward_calls"]) for w in row["windows"]]
    # The sequential endpoint backward (the default): one backward call per endpoint.
    assert windows == [([0, 1, 2, 3], "jagg", 2 * 2), ([4, 5, 6, 7], "exact", 4 * 2)]
    assert row["routing"] == {"source": "fraction", "routed": [True, False]}
    # The metrics line carries what the issue asks for.
    for key in ("loss", "clipfrac", "approx_kl", "grad_norm", "lr", "reward", "skipped"):
        assert key in row
    assert set(row["time"]) == {"forward", "backward", "optimizer", "load", "work"}
    assert row["reward"]["mean"] < 0  # -JPEG kB
    # The gradient diagnostic counts through the same accumulation loop: per micro-batch, the
    # same backward calls for the same trained steps, window and routing.
    report = run_gradcheck(
        GradcheckConfig(
            backbone="tiny-sd3", window=4, num_steps=9, jagg_frac=0.5, trajectory="sde", batch=2
        )
    )
    assert (
        report["backward_calls"]["jagg"] * row["micro_batches_per_rank"] == (row["backward_calls"])
    )


# --------------------------------------------------------------------------------------------
# Rounds, routing, the loop
# --------------------------------------------------------------------------------------------


def test_two_rounds_chain_policies_and_keep_auto_routing(tiny_sd3, tmp_path):
    """rollout -> score -> train twice: round numbers, optimizer/scheduler continue, the
    next rollout is sampled from the checkpoint (ratio 1), auto routing probed in round 0
    (every 2 rounds) and kept in round 1."""
    config = make_config(
        tiny_sd3,
        jagg={
            "mode": "jagg",
            "window": 4,
            "jagg_frac": "auto",
            "auto_threshold": 0.9,
            "auto_every": 2,
            "auto_probe_groups": 1,
        },
        grpo={"clip_range": 1e-4},
        train={"rounds": 2, "minibatches": 2, "lr_schedule": "linear", "warmup_steps": 1},
    )
    rounds = run_rounds(config, tmp_path)
    assert [r.round for r in rounds] == [0, 1, 2]
    assert rounds[0].policy == "base" and rounds[1].policy == str(rounds[0].checkpoint)
    assert rounds[2].checkpoint is None and rounds[2].policy == str(rounds[1].checkpoint)

    states = [read_trainer_state(r.checkpoint) for r in rounds[:2]]
    assert [(s.round, s.global_step) for s in states] == [(0, 2), (1, 4)]
    adam = ckpt.read_optimizer_state(rounds[1].checkpoint)["state"]
    assert {float(v["step"]) for v in adam.values()} == {4.0}
    metrics = [
        [json.loads(line) for line in (r.checkpoint / "metrics.jsonl").read_text().splitlines()]
        for r in rounds[:2]
    ]
    # Linear decay over rounds * minibatches = 4 steps after 1 warm-up step.
    lrs = [row["lr"] for rows in metrics for row in rows]
    assert lrs == pytest.approx(
        [1e-4 * lr_factor(s, total=4, warmup=1, kind="linear") for s in range(4)]
    )
    # Each round's first step recomputes its rollout's log-probs (sampled from the policy
    # being trained): no ratio leaves the 1e-4 clip range.
    assert [rows[0]["clipfrac"] for rows in metrics] == [0.0, 0.0]

    # metrics.jsonl is flat: nested records are dotted keys, list items numbered.
    first = metrics[0][0]
    steps = [[first[f"probe.{w}.steps.{i}"] for i in range(4)] for w in (0, 1)]
    assert steps == [[0, 1, 2, 3], [4, 5, 6, 7]]
    cos_sims = [first[f"probe.{w}.jagg.cos_sim"] for w in (0, 1)]
    assert all(-1.0 <= c <= 1.0 for c in cos_sims)
    routed = [c >= 0.9 for c in cos_sims]
    assert states[0].routing["routed"] == routed
    assert states[0].routing["probed_round"] == 0
    assert not any(key.startswith("probe.") for key in metrics[1][0])  # kept: no probe
    assert states[1].routing == states[0].routing
    for rows in metrics:
        modes = ["jagg" if r else "exact" for r in routed]
        assert [rows[0][f"windows.{w}.mode"] for w in (0, 1)] == modes


def test_probe_every_measures_cos_sims_without_changing_training(tiny_sd3, base_rollout, tmp_path):
    """jagg.probe_every (for the report's heatmap): the fixed routing and the trained weights
    stay exactly as without it; round 0 records a probe per window."""
    jagg = {"mode": "no_interp", "window": 4, "jagg_frac": 0.5, "auto_probe_groups": 1}
    plain = _train(make_config(tiny_sd3, jagg=jagg), base_rollout, tmp_path / "plain")
    probed = _train(
        make_config(tiny_sd3, jagg=jagg | {"probe_every": 3}), base_rollout, tmp_path / "probed"
    )
    want, got = policy_weights(tmp_path / "plain"), policy_weights(tmp_path / "probed")
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert probed.routing == plain.routing and probed.routing.source == "fraction"
    first = probed.metrics[0]
    for window in (0, 1):
        assert -1.0 <= first["probe"][window]["no_interp"]["cos_sim"] <= 1.0
    assert "probe" not in plain.metrics[0] and first["time"]["probe"] > 0


def test_rollout_velocities_are_reused_on_the_on_policy_step_only(tiny_sd3, base_rollout, tmp_path):
    """minibatches 2: the first optimizer step (weights = the rollout's) reuses the stored
    velocities, the second recomputes them; the result equals training without reuse."""
    jagg = {"mode": "jagg", "window": 4, "jagg_frac": 1.0}
    train = {"minibatches": 2}
    fast = _train(make_config(tiny_sd3, jagg=jagg, train=train), base_rollout, tmp_path / "a")
    jagg["reuse_velocities"] = False
    slow = _train(make_config(tiny_sd3, jagg=jagg, train=train), base_rollout, tmp_path / "b")
    paths = [[w["interior"] for w in row["windows"]] for row in fast.metrics]
    assert paths == [["reused", "reused"], ["recomputed", "recomputed"]]
    assert [[w["interior"] for w in row["windows"]] for row in slow.metrics] == [
        ["recomputed"] * 2
    ] * 2
    assert fast.metrics[0]["network_calls"] < slow.metrics[0]["network_calls"]
    assert fast.metrics[1]["network_calls"] == slow.metrics[1]["network_calls"]
    # float64 on CPU: the stored velocities are the recomputed ones.
    assert max_difference(policy_weights(tmp_path / "a"), policy_weights(tmp_path / "b")) <= 1e-15


def test_shared_anchors_train_with_the_rollouts_velocities(tiny_sd3, tmp_path):
    """jagg.anchors shared over 8 trained steps at W = 4: windows own steps 0-3, 4-6 and 7
    (anchors 0, 3, 6, 7: one backward call each, counted on the window that owns it); the
    rollout stores every step's velocity, the on-policy step reuses the interiors, and the
    update equals the one that recomputes them."""
    jagg = {"mode": "jagg", "window": 4, "jagg_frac": 1.0, "anchors": "shared"}
    config = make_config(tiny_sd3, jagg=jagg)
    rollout = scored_rollout(config, tmp_path / "round")
    fast = _train(config, rollout, tmp_path / "reuse")
    no_reuse = make_config(tiny_sd3, jagg=jagg | {"reuse_velocities": False})
    slow = _train(no_reuse, scored_rollout(no_reuse, tmp_path / "plain"), tmp_path / "recompute")
    (row,) = fast.metrics
    per_batch = row["micro_batches_per_rank"]
    windows = [(w["steps"], w["backward_calls"], w["interior"]) for w in row["windows"]]
    assert windows == [
        ([0, 1, 2, 3], 2 * per_batch, "reused"),
        ([4, 5, 6], 1 * per_batch, "reused"),
        ([7], 1 * per_batch, "none"),
    ]
    assert [w["interior"] for w in slow.metrics[0]["windows"]] == ["recomputed"] * 2 + ["none"]
    assert (
        max_difference(policy_weights(tmp_path / "reuse"), policy_weights(tmp_path / "recompute"))
        <= 1e-15
    )


def _update(config, checkpoint):
    """The flat float64 change a checkpoint made to the base weights."""
    from jagg_pipeline.stages.policy import load_policy

    base = load_policy(config, "base", for_training=True).transformer.state_dict()
    trained = policy_weights(checkpoint)
    return torch.cat([(trained[k].double() - base[k].double()).flatten() for k in sorted(trained)])


def test_bf16_mixed_precision_rollout_is_on_policy(tiny_sd3, tmp_path):
    """float32 weights, bf16 compute: the rollout computes in bf16 as FSDP2's policy does in
    training, so the first step's ratio is 1 and reusing the rollout's velocities gives the
    update that recomputing them gives. A rollout computed in float32 is refused."""
    jagg = {"mode": "jagg", "window": 4, "jagg_frac": 1.0}
    mixed = {"dtype": "float32", "mixed_precision": "bf16"}
    config = make_config(tiny_sd3, backbone=mixed, jagg=jagg)
    rollout = scored_rollout(config, tmp_path / "round")
    fast = _train(config, rollout, tmp_path / "reuse")
    no_reuse = make_config(tiny_sd3, backbone=mixed, jagg=jagg | {"reuse_velocities": False})
    slow = _train(no_reuse, rollout, tmp_path / "recompute")
    windows = fast.metrics[0]["windows"]
    assert [w["interior"] for w in windows] == ["reused", "reused"]
    assert not any(w["reuse_rejected"] for w in windows)
    for result in (fast, slow):
        first = result.metrics[0]
        assert first["max_ratio_dev"] <= config.grpo.clip_range / 100, first["max_ratio_dev"]
        assert first["clipfrac"] == 0.0
    a, b = _update(config, tmp_path / "reuse"), _update(config, tmp_path / "recompute")
    assert float(a @ b / (a.norm() * b.norm())) > 0.999
    assert float((a - b).norm() / a.norm()) < 1e-2

    plain = make_config(tiny_sd3, backbone={"dtype": "float32"}, jagg=jagg)
    with pytest.raises(ManifestError, match="backbone"):
        _train(config, scored_rollout(plain, tmp_path / "float32"), tmp_path / "refused")


def test_a_changed_base_checkpoint_is_noticed_by_value(tiny_sd3, tmp_path, capsys):
    """The base folder changed between rollout and training (no digest covers it): the
    recomputed endpoints disagree with the stored velocities, so the interiors are
    recomputed, the window records say so and a warning names the deviation."""
    import shutil

    from safetensors.torch import load_file, save_file

    base = shutil.copytree(tiny_sd3, tmp_path / "base")
    jagg = {"mode": "jagg", "window": 4, "jagg_frac": 1.0}
    rollout = scored_rollout(make_config(base, jagg=jagg), tmp_path / "round")
    weights = base / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    save_file({k: v * 1.01 for k, v in state.items()}, str(weights))
    changed = _train(make_config(base, jagg=jagg), rollout, tmp_path / "reuse")
    assert "the rollout's velocities differ from the recomputed ones" in capsys.readouterr().err
    windows = changed.metrics[0]["windows"]
    assert all(w["reuse_rejected"] and w["interior"] == "recomputed" for w in windows)
    assert min(w["reuse_error"] for w in windows) > 1e-3
    no_reuse = make_config(base, jagg=jagg | {"reuse_velocities": False})
    _train(no_reuse, rollout, tmp_path / "recompute")
    reused, recomputed = policy_weights(tmp_path / "reuse"), policy_weights(tmp_path / "recompute")
    assert max_difference(reused, recomputed) == 0.0


def test_decide_routing_probes_on_schedule():
    calls = []

    def probe():
        calls.append(1)
        return [
            {"steps": [0, 1], "jagg": {"cos_sim": 0.95}},
            {"steps": [2, 3], "jagg": {"cos_sim": 0.5}},
        ]

    def settings(**changes):
        base = {"mode": "jagg", "jagg_frac": "auto", "auto_threshold": 0.8, "auto_every": 3}
        return type("Jagg", (), {**base, **changes})

    first = decide_routing(settings(), 2, 0, None, probe)
    assert (first.routed, first.source, first.probed_round) == ([True, False], "auto", 0)
    assert decide_routing(settings(), 2, 1, first, probe) is first  # kept
    assert decide_routing(settings(), 2, 3, first, probe).probed_round == 3  # every 3 rounds
    assert decide_routing(settings(), 3, 1, first, probe).probed_round == 1  # other windows
    assert len(calls) == 3
    nan = decide_routing(
        settings(), 1, 0, None, lambda: [{"steps": [0], "jagg": {"cos_sim": float("nan")}}]
    )
    assert nan.routed == [False]
    assert decide_routing(settings(mode="exact"), 2, 0, None, probe).routed == [False, False]
    frac = decide_routing(settings(jagg_frac=0.5), 4, 0, None, probe)
    assert (frac.routed, frac.source) == ([True, True, False, False], "fraction")
    assert Routing.from_dict(None) is None
    assert len(calls) == 3


def test_plan_steps_deals_whole_micro_batches_evenly():
    plan = plan_steps(8, 2, 2, torch.Generator().manual_seed(0))
    assert [[len(rank) for rank in step] for step in plan] == [[2, 2], [2, 2]]
    assert sorted(m for step in plan for rank in step for m in rank) == list(range(8))
    assert plan == plan_steps(8, 2, 2, torch.Generator().manual_seed(0))
    with pytest.raises(TrainInputError, match=r"train\.minibatches=3"):
        plan_steps(8, 3, 1, torch.Generator())
    with pytest.raises(TrainInputError, match=r"train\.nproc"):
        plan_steps(6, 2, 2, torch.Generator())


def test_lr_schedule():
    assert [lr_factor(s, total=5, warmup=2, kind="constant") for s in range(4)] == [0.5, 1, 1, 1]
    assert lr_factor(4, total=5, warmup=0, kind="linear") == pytest.approx(0.2)
    assert lr_factor(0, total=5, warmup=0, kind="cosine") == 1.0
    assert lr_factor(5, total=5, warmup=0, kind="cosine") == pytest.approx(0.0)


# --------------------------------------------------------------------------------------------
# Inputs that do not fit
# --------------------------------------------------------------------------------------------


def test_inputs_that_do_not_fit_are_refused_naming_the_file(tiny_sd3, base_rollout, tmp_path):
    rollouts, table = base_rollout
    config = make_config(tiny_sd3)
    other_sampler = make_config(tiny_sd3, sampler={"num_steps": 7})
    with pytest.raises(
        ManifestError, match=f"{re.escape(str(rollouts))}: .*different config section sampler"
    ):
        load_round_data(other_sampler, "base", rollouts, table)
    # Advantages computed under other settings than the trainer's config names.
    for section, values in [
        ("advantage", {"eps": 0.5}),
        ("rewards", {"normalize_separately": True}),
    ]:
        other = make_config(tiny_sd3, **{section: values})
        with pytest.raises(
            ManifestError, match=f"{re.escape(str(table))}: .*different config section {section}"
        ):
            load_round_data(other, "base", rollouts, table)
    # ... but a loss setting the score stage never read does not refuse its table.
    load_round_data(make_config(tiny_sd3, grpo={"clip_range": 0.5}), "base", rollouts, table)
    # A score table of other rollouts (another round of the same policy).
    other_rollouts, other_table = scored_rollout(config, tmp_path / "r1", round_index=1)
    with pytest.raises(
        ManifestError, match=re.escape(f"{other_table}: was not computed from {rollouts}")
    ):
        load_round_data(config, "base", rollouts, other_table)
    # Rollouts of round 1 for a base policy (round 0).
    with pytest.raises(TrainInputError, match="sampled for round 1"):
        train_round(config, "base", other_rollouts, other_table, tmp_path / "x", progress=False)
    # A checkpoint's next round on rollouts sampled from the base policy.
    trained = _train(config, base_rollout, tmp_path / "ckpt").checkpoint
    with pytest.raises(TrainInputError, match="sample the rollouts from --policy"):
        load_round_data(config, trained, rollouts, table)
    # A table whose rows are not the rollout's samples in order.
    rows = read_table(table_path(table))
    shuffled = train_helpers.forged_scores(table, tmp_path / "shuffled", rows[1:] + rows[:1])
    with pytest.raises(
        TrainInputError, match=re.escape(f"{table_path(shuffled)}: column 'sample'")
    ):
        load_round_data(config, "base", rollouts, shuffled)
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------------------------
# Non-finite state
# --------------------------------------------------------------------------------------------


def test_nonfinite_loss_skips_the_step_and_a_round_of_skipped_steps_fails(
    tiny_sd3, base_rollout, tmp_path
):
    rollouts, table = base_rollout
    rows = read_table(table_path(table))
    rows[3]["advantage"] = float("nan")
    poisoned = train_helpers.forged_scores(table, tmp_path / "nan", rows)
    # Two optimizer steps: the one holding sample 3 is skipped and counted, the other applied.
    config = make_config(tiny_sd3, train={"minibatches": 2})
    result = _train(config, (rollouts, poisoned), tmp_path / "two")
    assert [row["skipped"] for row in result.metrics].count(True) == 1
    assert read_trainer_state(result.checkpoint).skipped_steps == 1
    trained = policy_weights(result.checkpoint)
    assert all(torch.isfinite(w).all() for w in trained.values())
    # One step, skipped: the whole round did nothing, which fails loudly...
    config = make_config(tiny_sd3, train={"ema_decay": 0.5})
    with pytest.raises(NonFiniteError, match=r"round 0: all 1 optimizer step\(s\) were skipped"):
        _train(config, (rollouts, poisoned), tmp_path / "failed")
    assert not (tmp_path / "failed").exists()
    # ... unless tolerated: the unchanged policy is written.
    config = make_config(tiny_sd3, train={"ema_decay": 0.5, "allow_skipped_round": True})
    result = _train(config, (rollouts, poisoned), tmp_path / "ckpt")
    (row,) = result.metrics
    assert row["skipped"] and row["skipped_steps"] == 1
    assert read_trainer_state(result.checkpoint).skipped_steps == 1
    trained = policy_weights(result.checkpoint)
    base = train_helpers.base_weights(tiny_sd3)
    assert all(torch.equal(trained[k], base[k]) for k in trained)  # no update applied
    assert ckpt.read_ema_state(result.checkpoint).keys() == trained.keys()
    line = (result.checkpoint / "metrics.jsonl").read_text()
    assert '"loss": null' in line  # strict JSON


def test_nonfinite_weights_write_no_checkpoint(tiny_sd3, base_rollout, tmp_path):
    config = make_config(tiny_sd3, train={"lr": 1e308, "grad_clip": 0.0})
    with pytest.raises(NonFiniteError, match="no checkpoint written"):
        _train(config, base_rollout, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    assert not staging_path(tmp_path / "ckpt").exists()


# --------------------------------------------------------------------------------------------
# LoRA, EMA, KL, mixed precision; the checkpoint format
# --------------------------------------------------------------------------------------------


def test_lora_training_is_reproducible_and_follows_the_seed(tiny_sd3, tmp_path):
    """Equal configs train byte-identical adapters, whatever ran before in the process (the
    adapters' random A matrices come from backbone.lora.seed); another seed, other adapters."""
    lora = {"training": "lora", "lora": {"rank": 2}}
    config = make_config(tiny_sd3, backbone=lora)
    rollout = scored_rollout(config, tmp_path / "r0")
    _train(config, rollout, tmp_path / "a")
    torch.rand(1000)  # move the global generator between the two runs
    _train(config, rollout, tmp_path / "b")
    assert_same_checkpoint(tmp_path / "b", tmp_path / "a")
    other = make_config(tiny_sd3, backbone={**lora, "lora": {"rank": 2, "seed": 1}})
    _train(other, scored_rollout(other, tmp_path / "r1"), tmp_path / "c")
    a, c = policy_weights(tmp_path / "a"), policy_weights(tmp_path / "c")
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_lora_ema_kl_bf16_checkpointing_checkpoint_is_the_next_policy(tiny_sd3, tmp_path):
    from jagg_pipeline.stages.policy import load_policy

    config = make_config(
        tiny_sd3,
        backbone={
            "training": "lora",
            "lora": {"rank": 2},
            "gradient_checkpointing": True,
            "mixed_precision": "bf16",
        },
        grpo={"kl_beta": 0.1},
        train={"ema_decay": 0.9, "lr": 1e-3},
    )
    rollout = scored_rollout(config, tmp_path / "r0")
    result = _train(config, rollout, tmp_path / "ckpt")
    out = result.checkpoint
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert names == {
        "manifest.json",
        "config.yaml",
        "metrics.jsonl",
        "policy/.metadata",
        "policy/__0_0.distcp",
        "trainer/state.json",
        "trainer/optimizer/.metadata",
        "trainer/optimizer/__0_0.distcp",
        "trainer/rng.safetensors",
        "trainer/ema/.metadata",
        "trainer/ema/__0_0.distcp",
    }
    assert json.loads((out / "manifest.json").read_text())["stage"] == "train"
    adapters = policy_weights(out)
    assert adapters and all("lora_" in k for k in adapters)
    ema = ckpt.read_ema_state(out)
    assert ema and all("lora_" in k for k in ema)
    assert set(ckpt.read_optimizer_state(out)["state"]) == set(ema)
    assert torch.isfinite(torch.tensor(result.metrics[0]["loss"]))
    # The checkpoint is the next round's policy; LoRA B starts at zero, so a trained B moved.
    backbone = load_policy(config, out)
    lora_b = [p.detach() for n, p in backbone.transformer.named_parameters() if "lora_B" in n]
    assert any(float(p.abs().max()) > 0 for p in lora_b)


def test_checkpoint_writes_are_atomic(tiny_sd3, tmp_path, monkeypatch):
    """A write that dies half-way leaves nothing under the target; the next write clears the
    leftovers; an existing checkpoint is replaced whole."""
    import dataclasses

    from jagg_pipeline.backbones import load_backbone
    from jagg_pipeline.io import manifest

    config = make_config(tiny_sd3)
    backbone = load_backbone(dataclasses.replace(config.backbone, load_text_encoders=False))
    weights = {n: p.detach() for n, p in backbone.transformer.named_parameters()}

    def contents(scale):
        return ckpt.CheckpointContents(
            model_state={n: scale * w for n, w in weights.items()},
            optimizer_state={"state": {}, "param_groups": []},
            rng_state=torch.Generator().get_state(),
            trainer=ckpt.TrainerState(round=0, global_step=1, skipped_steps=0, scheduler={}),
        )

    def write(scale):
        options = {"config": config, "seeds": {}, "inputs": {}, "extra": {}}
        with distributed.distributed("cpu"):
            return ckpt.write_checkpoint(target, contents(scale), **options)

    target = tmp_path / "ckpt"
    original = manifest.finish_output

    def dies(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(manifest, "finish_output", dies)
    with pytest.raises(KeyboardInterrupt):
        write(1.0)
    assert not target.exists() and not staging_path(target).exists()
    monkeypatch.setattr(manifest, "finish_output", original)
    # What a SIGKILL leaves (no cleanup runs): the next write clears it.
    for leftover in (staging_path(target), target.with_name(".ckpt.old")):
        (leftover / "trainer").mkdir(parents=True)
    write(1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    write(2.0)
    assert max_difference(policy_weights(target), {n: 2 * w for n, w in weights.items()}) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(NonFiniteError, match="non-finite values"):
        write(float("nan"))
    assert max_difference(policy_weights(target), {n: 2 * w for n, w in weights.items()}) == 0


# --------------------------------------------------------------------------------------------
# Kill and rerun
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_mid_round_then_rerun_equals_an_uninterrupted_run(tiny_sd3, tmp_path):
    """Test 4: SIGKILL after the first of 4 optimizer steps; the rerun's checkpoint is the
    uninterrupted run's bit for bit (every file; metrics without their timings)."""
    config = make_config(
        tiny_sd3,
        sampler={"batch_size": 4},
        jagg={"mode": "exact"},
        train={"minibatches": 4, "ema_decay": 0.9},
    )
    rollouts, table = scored_rollout(config, tmp_path / "r0")
    reference = train_round(config, "base", rollouts, table, tmp_path / "ref", progress=False)

    out = tmp_path / "ckpt"
    args = ["--config", str(write_config(config, tmp_path / "config.yaml")), "--policy", "base"]
    args += ["--rollouts", str(rollouts), "--scores", str(table), "--out", str(out)]
    command = [*launcher(None), "-m", "jagg_pipeline", "train", *args]
    process = subprocess.Popen(
        command, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue = queue.Queue()

    def read_stderr():
        for line in process.stderr:
            lines.put(line)

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        while "step 1/4" not in lines.get(timeout=120):  # one line per optimizer step
            pass
    finally:
        process.kill()  # SIGKILL, while step 2 runs
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL  # (0 would mean it had finished already)
    assert not out.exists()  # nothing half-written under the final name

    train_helpers.run_train_command(args)
    train_helpers.assert_same_checkpoint(out, reference.checkpoint)


def test_train_help_names_what_the_checkpoint_writer_writes(capsys):
    """The output listing of ``train --help`` is the checkpoint's layout, as its constants
    name it, and no other file name appears anywhere in the help."""
    from jagg_pipeline.cli import main
    from jagg_pipeline.io.artifacts import METRICS_NAME, POLICY_DIR
    from jagg_pipeline.io.manifest import CONFIG_NAME, MANIFEST_NAME

    trainer = ckpt.TRAINER_DIR
    written = {
        f"{POLICY_DIR}/",
        f"{trainer}/{ckpt.STATE_FILE}",
        f"{trainer}/{ckpt.OPTIMIZER_DIR}/",
        f"{trainer}/{ckpt.EMA_DIR}/",
        f"{trainer}/{ckpt.RNG_FILE}",
        METRICS_NAME,
        CONFIG_NAME,
        MANIFEST_NAME,
    }
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    listing = text.partition("output directory")[2]
    entries = re.findall(r"^  ([^\s,]+(?:, [^\s,]+)*)", listing, flags=re.MULTILINE)
    listed = {name for entry in entries for name in entry.split(", ")}
    assert listed == written
    files = set(re.findall(r"[\w.-]+\.(?:safetensors|distcp|jsonl?|ya?ml|bin|pt)\b", text))
    assert files <= {name.rpartition("/")[2] for name in written}


def test_train_command_documents_outputs_and_names_bad_inputs(tiny_sd3, tmp_path, capsys):
    from jagg_pipeline.cli import main

    with pytest.raises(SystemExit) as exit_help:
        main(["train", "--help"])
    assert exit_help.value.code == 0
    text = capsys.readouterr().out
    for word in ("--rollouts", "--scores", "--policy", "torchrun", "metrics.jsonl", "routing"):
        assert word in text
    with pytest.raises(SystemExit) as renamed:  # the score folder's old flag names the new one
        main(["train", "--rewards", str(tmp_path / "scores")])
    assert renamed.value.code == 2
    assert "--rewards is now --scores" in capsys.readouterr().err
    config = write_config(make_config(tiny_sd3), tmp_path / "config.yaml")
    missing = tmp_path / "nowhere"
    args = ["train", "--config", str(config), "--policy", "base", "--rollouts", str(missing)]
    with pytest.raises(SystemExit, match=f"error: .*{re.escape(str(missing))}"):
        main([*args, "--scores", str(tmp_path / "scores"), "--out", str(tmp_path / "o")])
