"""The speed benchmark's behaviour (not its figures: timings are noisy; README has those).

What it counts must be what the engines do: backward calls per window, network calls and
reused rows, the analytic predictions, one reduce-scatter per parameter group per optimizer
step in every mode on two ranks; its outputs are written and readable.
"""

from __future__ import annotations

import csv
import json

import pytest

from jagg_pipeline.bench import Case, format_report, predicted_cost, run_bench, write_outputs
from jagg_pipeline.bench_settings import BenchSettings

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


@pytest.mark.slow
def test_bench_counts_what_the_engines_do_and_writes_its_outputs(tmp_path):
    settings = BenchSettings(
        backbones=["toy-flux"],
        sweep_backbone="toy-flux",
        windows=[4, 8],
        fracs=[1.0],
        num_steps=9,
        repeats=2,
        warmup=0,
        ranks=2,
    )
    report = run_bench(settings, progress=lambda _: None)
    (backbone,) = report["backbones"]
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
    assert whole["rollout"] > 0 and set(whole["round_speedup"]) == set(list(rows)[:6])
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
