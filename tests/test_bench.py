"""The speed benchmark's behaviour (not its figures: timings are noisy; docs/performance.md
has those).

What it counts must be what the engines do: backward calls per window, network calls and
reused rows, the analytic predictions, one reduce-scatter per parameter group per optimizer
step in every mode on two ranks; its outputs are written and readable.
"""

from __future__ import annotations

import csv
import json

import pytest

from jagg_pipeline.bench.config import BenchConfig
from jagg_pipeline.bench.measure import Case, analytic_rows, predicted_cost, run_bench
from jagg_pipeline.bench.report import format_report, write_outputs

STEPS = list(range(8))


def test_predicted_costs_follow_the_schedule():
    """In forward-equivalents: exact 3 per step, jagg W + 4 per window, with reuse 6."""
    exact = predicted_cost(Case("exact", 4, 0.0), STEPS)
    assert exact == 24
    assert predicted_cost(Case("jagg", 4, 1.0), STEPS) == 2 * 8  # 1.5x
    assert predicted_cost(Case("jagg", 4, 1.0, reuse=True), STEPS) == 2 * 6  # 2x
    assert predicted_cost(Case("jagg", 8, 1.0, reuse=True), STEPS) == 6  # 4x = W / 2
    assert predicted_cost(Case("no_interp", 4, 1.0), STEPS) == 2 * 6
    assert predicted_cost(Case("jagg", 2, 1.0), STEPS) == exact  # W = 2 is exact's cost
    assert predicted_cost(Case("jagg", 4, 0.5), STEPS) == 8 + 12  # one window routed


@pytest.mark.parametrize(
    ("trained", "rows", "speedup"),
    [
        (12, {"exact": 12, "separate": 6, "shared": 5}, 2.4),
        (16, {"exact": 16, "separate": 8, "shared": 6}, 8 / 3),
    ],
)
def test_shared_anchors_need_about_one_row_per_w_minus_one_steps(trained, rows, speedup):
    """Anchors every W - 1 steps: N / (W - 1) + 1 rows with grad against 2N / W (separate)."""
    steps = list(range(trained))
    exact = Case("exact", 4, 0.0)
    assert analytic_rows(exact, steps) == (rows["exact"], 0)
    for anchors in ("separate", "shared"):
        reused = Case("jagg", 4, 1.0, reuse=True, anchors=anchors)
        assert analytic_rows(reused, steps) == (rows[anchors], 0)
        recomputed = Case("jagg", 4, 1.0, anchors=anchors)
        assert analytic_rows(recomputed, steps) == (rows[anchors], trained - rows[anchors])
    shared = Case("jagg", 4, 1.0, reuse=True, anchors="shared")
    assert predicted_cost(exact, steps) / predicted_cost(shared, steps) == pytest.approx(speedup)
    # Half the windows routed (12: 2 of 4, steps 0-6; 16: 3 of 5, steps 0-9): anchors every
    # 3 steps on the routed run, one row per step on the rest.
    half = Case("jagg", 4, 0.5, reuse=True, anchors="shared")
    run = 7 if trained == 12 else 10
    assert analytic_rows(half, steps)[0] == run // 3 + 1 + trained - run


@pytest.mark.slow
def test_bench_counts_what_the_engines_do_and_writes_its_outputs(tmp_path):
    settings = BenchConfig(
        backbones=["toy-flux"],
        sweep_backbone="toy-flux",
        windows=[4, 8],
        fracs=[1.0],
        num_steps=9,
        long_steps=13,
        repeats=2,
        warmup=0,
        ranks=2,
    )
    report = run_bench(settings, progress=lambda _: None)
    backbone, longer = report["backbones"]
    rows = {row["case"]: row for row in backbone["cases"]}
    assert backbone["trained_steps"] == STEPS
    expected = {  # backward calls, network calls, reused rows, predicted speed-up
        "exact": (8, 8, 0, 1.0),
        "jagg W=4 f=1": (2, 4, 0, 1.5),
        "jagg+reuse W=4 f=1": (2, 2, 4, 2.0),
        # Sequential: the same forwards, each endpoint its own call and backward call.
        "jagg W=4 f=1 sequential": (4, 6, 0, 1.5),
        "jagg+reuse W=4 f=1 sequential": (4, 4, 4, 2.0),
        "no_interp W=4 f=1": (2, 2, 0, 2.0),
        "jagg+reuse W=8 f=1": (1, 1, 6, 4.0),
        # Shared anchors 0, 3, 6, 7: interiors 1-2 and 4-5 (one stacked forward each).
        "jagg W=4 f=1 shared": (1, 3, 0, 24 / 16),
        "jagg+reuse W=4 f=1 shared": (1, 1, 4, 2.0),
        "jagg+reuse W=4 f=1 shared sequential": (4, 4, 4, 2.0),
    }
    for case, (backward, network, reused, predicted) in expected.items():
        row = rows[case]
        assert (row["backward_calls"], row["network_calls"], row["reused_rows"]) == (
            backward,
            network,
            reused,
        ), case
        assert row["predicted_speedup"] == pytest.approx(predicted)
        assert row["seconds"]["update"]["median"] > 0
        assert row["peak_activation_bytes"] > 0
    # Joint: both endpoints' activations are alive for the one backward, twice exact's step;
    # sequential: one endpoint's at a time, exact's.
    exact_peak = rows["exact"]["peak_activation_bytes"]
    for reuse in ("", "+reuse"):
        joint, sequential = (rows[f"jagg{reuse} W=4 f=1{s}"] for s in ("", " sequential"))
        assert joint["peak_activation_bytes"] == pytest.approx(2 * exact_peak, rel=0.05)
        assert sequential["peak_activation_bytes"] == pytest.approx(exact_peak, rel=0.05)
    whole = backbone["round"]
    assert whole["rollout"] > 0 and set(whole["round_speedup"]) == set(list(rows)[:9])
    # The headline cases again over 12 trained steps: 5 anchor rows, 2.4x analytic.
    long_rows = {row["case"]: row for row in longer["cases"]}
    assert len(longer["trained_steps"]) == 12 and set(long_rows) == set(list(rows)[:9])
    shared = long_rows["jagg+reuse W=4 f=1 shared"]
    assert (shared["analytic_rows"], shared["backward_calls"]) == (5, 1)
    assert shared["predicted_speedup"] == pytest.approx(2.4)
    reduce = report["reduce_scatters"]
    assert reduce["world_size"] == 2
    assert set(reduce["per_step"].values()) == {reduce["groups"]}  # once per group per step

    paths = write_outputs(report, tmp_path)
    assert json.loads(paths["json"].read_text())["device"] == report["device"]
    with open(paths["csv"]) as handle:
        assert {r["case"] for r in csv.DictReader(handle)} == set(rows)
    assert paths["png"].stat().st_size > 10_000
    printed = format_report(report)
    assert "jagg+reuse W=4 f=1" in printed and "reduce-scatters" in printed


def test_round_overhead_projection_scales_each_hashing_pattern_to_eight_ranks():
    # benchmarks/round_overhead.py's arithmetic on made-up sizes (a script, not a module).
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from round_overhead import NODE_RANKS, SETTINGS, hash_pattern, project, projected_hashing

    def pattern(ranks, **hashed):
        stage = {
            "ranks": ranks,
            "hash_by_artifact": {k.replace("_", " "): v for k, v in hashed.items()},
        }
        return hash_pattern(stage, {"policy in": 10, "policy out": 10, "rollout": 4})

    # Before: both ranks hash the input whole, rank 0 its own output: 8 x 100 + 100 bytes on
    # the node; the critical path is rank 0's 200 bytes.
    before = pattern(2, policy_in=[10, 10], policy_out=[10, 0])
    assert projected_hashing(before, {"policy in": 100, "policy out": 100}, 10.0) == (900, 20)
    # After: once per node, spread over the ranks.
    after = pattern(2, policy_in=[6, 4])
    assert projected_hashing(after, {"policy in": 100}, 10.0) == (100, 100 / NODE_RANKS / 10)
    # One process stays one; an artifact of no listed size keeps its measured bytes.
    single = pattern(1, rollout=[4], scores=[3])
    assert projected_hashing(single, {"rollout": 40}, 10.0) == (43, 4.3)

    # Sizes in GB, rates in GB/s: the 3-6 GB/s storage is in the same units.
    gb = 1e9
    sizes = {
        "base": 240 * gb,
        "base_in_dtype": 480 * gb,
        "text_encoders": 60 * gb,
        "policy": 100 * gb,
        "trainer": 200 * gb,
        "checkpoint": 300 * gb,
        "rollout": 40 * gb,
        "images": 4 * gb,
        "micro_batches": 12,
    }
    score = pattern(1, rollout=[4])
    patterns = {
        "before": {"rollout": pattern(1, policy_in=[10], rollout=[4]), "score": score},
        "after": {"rollout": after, "score": score},
    }
    patterns["before"]["train"] = before
    patterns["after"]["train"] = pattern(2, policy_in=[5, 5], rollout=[2, 2])
    rates = {"sha256": 10 * gb, "blake3_1_thread": 20 * gb}
    out = project(
        patterns,
        {"before": 3.0, "after": 5.0},
        {"before": False, "after": True},
        rates,
        sizes,
        SETTINGS[0],
    )
    for tree in ("before", "after"):
        items = out["items"][tree]
        rest = [v for k, v in items["seconds"].items() if not k.startswith("0")]
        assert items["overhead_s"][0] == pytest.approx(sum(v[0] for v in rest))
        assert items["overhead_s"][1] == pytest.approx(sum(v[-1] for v in rest))
    before_items, after_items = out["items"]["before"], out["items"]["after"]
    assert before_items["seconds"]["0 idle GPUs while sampling"] == (390.0,)
    # 12 micro-batches on 8 ranks: 2 rounds of dealing for 1.5 of work.
    idle = 390.0 * 8 / 7 / 8 * (16 / 12 - 1)
    assert after_items["seconds"]["0 idle GPUs while sampling"][0] == pytest.approx(idle)
    # Before: the rollout hashes 100 + 40 GB, the score stage 40, the train ranks 800 + 100,
    # at 10 GB/s on their critical paths (140 GB, 40 GB and rank 0's 200 GB).
    assert before_items["hashed_bytes"] == pytest.approx(1080 * gb)
    assert before_items["seconds"]["1 hashing by reading"][0] == pytest.approx(14 + 4 + 20)
    assert after_items["seconds"]["1 hashing while writing"][0] == pytest.approx(340 / 8 / 20)
    # After, training: the 140 GB the ranks hash come off storage at 3 and at 6 GB/s, their
    # hashing (140 / 8 GB each at 20 GB/s) hides that much; nothing unhashed (full FT).
    critical = 140 / NODE_RANKS / 20
    reads = after_items["seconds"]["3 train: checkpoint, base, rollout reads"]
    assert reads == pytest.approx((140 / 3 - critical, 140 / 6 - critical))
    # Before, training: hashing (20 s) hides the checkpoint's storage time; the base
    # transformer (240 GB, in no manifest) is read on top.
    reads = before_items["seconds"]["3 train: checkpoint, base, rollout reads"]
    assert reads == pytest.approx((max(100 / 3 - 20, 0) + 80, max(100 / 6 - 20, 0) + 40))
