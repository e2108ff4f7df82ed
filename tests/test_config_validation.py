"""Every bad value is refused when the config is loaded, naming its key (issue: reliability).

A table of distinct bad configs, each a YAML snippet over the defaults, each refused by
:func:`jagg_pipeline.config.run.load_config` with a message that names the file and the dotted
key; and the command line refuses one in well under 5 s (the loader imports no torch).
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import time

import pytest

from jagg_pipeline.config.run import ConfigError, load_config

# name -> (YAML over the defaults, the key the message must name, what it must say)
BAD = {
    # advantages and the policy loss
    "eps negative": ("advantage: {eps: -1.0e-4}", "advantage.eps", "above 0"),
    "eps zero (zero-std group: NaN)": ("advantage: {eps: 0}", "advantage.eps", "above 0"),
    "adv clip negative": ("advantage: {clip: -1}", "advantage.clip", "above 0"),
    "std mode": ("advantage: {std_mode: batch}", "advantage.std_mode", "not one of"),
    "unquoted no (YAML: false)": (
        "backbone: {mixed_precision: no}",
        "backbone.mixed_precision",
        "write it in quotes, e.g. 'no'",
    ),
    "clip range zero": ("grpo: {clip_range: 0}", "grpo.clip_range", "above 0"),
    "clip range negative": ("grpo: {clip_range: -0.1}", "grpo.clip_range", "above 0"),
    "kl beta negative": ("grpo: {kl_beta: -1}", "grpo.kl_beta", "minimum"),
    "kl beta inf": ("grpo: {kl_beta: .inf}", "grpo.kl_beta", "finite"),
    # sampler
    "noise level inf": ("sampler: {noise_level: .inf}", "sampler.noise_level", "finite"),
    "noise level negative": ("sampler: {noise_level: -0.5}", "sampler.noise_level", "minimum"),
    "num steps zero": ("sampler: {num_steps: 0}", "sampler.num_steps", "minimum"),
    "group size one": ("sampler: {group_size: 1}", "sampler.group_size", "minimum"),
    "batch not whole groups": (
        "sampler: {group_size: 2, batch_size: 3}",
        "sampler.batch_size",
        "multiple of sampler.group_size",
    ),
    "trained fraction zero": (
        "sampler: {trajectory: full, trained_fraction: 0}",
        "sampler.trained_fraction",
        "above 0",
    ),
    "trained fraction 1.5": ("sampler: {trained_fraction: 1.5}", "sampler.trained_fraction", "max"),
    "segment start reversed": (
        "sampler: {segment_start: [3, 1]}",
        "sampler.segment_start",
        "lo, hi",
    ),
    "sde segment past the end": (
        "sampler: {num_steps: 6, segment_steps: 8}",
        "sampler.segment_start",
        "exceeds num_steps",
    ),
    "old sde window size": (
        "sampler: {window_size: 4}",
        "sampler.window_size",
        "window_size is now sampler.segment_steps",
    ),
    "old sde window start": (
        "sampler: {window_start: [0, 1]}",
        "sampler.window_start",
        "window_start is now sampler.segment_start",
    ),
    "old trajectory name": (
        "sampler: {trajectory: window}",
        "sampler.trajectory",
        "'window' is now called 'segment'",
    ),
    "step family": ("sampler: {step: ddim}", "sampler.step", "not one of"),
    "prompts per round zero": (
        "sampler: {prompts_per_round: 0}",
        "sampler.prompts_per_round",
        "min",
    ),
    "sampler batch text": ("sampler: {batch_size: sixteen}", "sampler.batch_size", "integer"),
    # jagg
    "window one": ("jagg: {window: 1}", "jagg.window", "minimum"),
    "window over trained steps": ("jagg: {window: 9}", "jagg.window", "trained steps"),
    "jagg frac 1.5": ("jagg: {jagg_frac: 1.5}", "jagg.jagg_frac", "maximum"),
    "jagg frac word": ("jagg: {jagg_frac: half}", "jagg.jagg_frac", "fits none"),
    "auto threshold 2": ("jagg: {auto_threshold: 2}", "jagg.auto_threshold", "maximum"),
    "auto every zero": ("jagg: {auto_every: 0}", "jagg.auto_every", "minimum"),
    "mode": ("jagg: {mode: approx}", "jagg.mode", "not one of"),
    # train
    "lr zero": ("train: {lr: 0}", "train.lr", "above 0"),
    "lr text inf": ("train: {lr: inf}", "train.lr", "expected a number"),
    "grad clip negative": ("train: {grad_clip: -1}", "train.grad_clip", "minimum"),
    "warmup negative": ("train: {warmup_steps: -1}", "train.warmup_steps", "minimum"),
    "minibatches zero": ("train: {minibatches: 0}", "train.minibatches", "minimum"),
    "minibatches over groups": (
        "train: {minibatches: 9}",
        "train.minibatches",
        "prompts_per_round",
    ),
    "betas one value": ("train: {betas: [0.9]}", "train.betas", "two"),
    "beta of one": ("train: {betas: [0.9, 1.0]}", "train.betas", "[0, 1)"),
    "beta negative": ("train: {betas: [-0.1, 0.999]}", "train.betas", "[0, 1)"),
    "weight decay negative": ("train: {weight_decay: -0.01}", "train.weight_decay", "minimum"),
    "nproc zero": ("train: {nproc: 0}", "train.nproc", "minimum"),
    "nproc over micro-batches": ("train: {nproc: 3}", "train.nproc", "cannot share"),
    "nodes zero": ("train: {nodes: 0}", "train.nodes", "minimum"),
    "nodes x nproc over micro-batches": (
        "train: {nodes: 2, nproc: 4}",
        "train.nodes",
        "8 processes (train.nodes 2 x train.nproc 4)",
    ),
    "rounds zero": ("train: {rounds: 0}", "train.rounds", "minimum"),
    "ema decay 1.5": ("train: {ema_decay: 1.5}", "train.ema_decay", "maximum"),
    "seed negative": ("train: {seed: -1}", "train.seed", "minimum"),
    "schedule": ("train: {lr_schedule: step}", "train.lr_schedule", "not one of"),
    "mixed precision": (
        "backbone: {mixed_precision: fp16}",
        "backbone.mixed_precision",
        "not one of",
    ),
    "mixed precision moved": (
        "train: {mixed_precision: bf16}",
        "train.mixed_precision",
        "is now backbone.mixed_precision",
    ),
    "mixed precision over fp16": (
        "backbone: {dtype: float16, mixed_precision: bf16}",
        "backbone.mixed_precision",
        "backbone.dtype",
    ),
    # rewards and eval
    "reward weight inf": (
        "rewards: {weights: {toy_attributes: .inf}}",
        "rewards.weights",
        "finite",
    ),
    "reward weight nan": (
        "rewards: {weights: {toy_attributes: .nan}}",
        "rewards.weights",
        "finite",
    ),
    "unknown reward": ("rewards: {weights: {nope: 1}}", "rewards.weights.nope", "unknown reward"),
    "no reward": ("rewards: {weights: {}}", "rewards.weights", "at least one"),
    "eval metric unknown": ("eval: {metrics: [nope_metric]}", "eval.metrics", "unknown reward"),
    "eval max prompts zero": ("eval: {max_prompts: 0}", "eval.max_prompts", "minimum"),
    "eval every zero": ("eval: {every: 0}", "eval.every", "minimum"),
    "eval seed negative": ("eval: {seed: -5}", "eval.seed", "minimum"),
    "jpeg quality": ("rewards: {jpeg_compressibility: {quality: 0}}", "quality", "minimum"),
    # backbone
    "family": ("backbone: {family: sdxl}", "backbone.family", "not one of"),
    "height not a multiple of 16": ("backbone: {height: 30}", "backbone.height", "multiple of 16"),
    "width zero": ("backbone: {width: 0}", "backbone.width", "minimum"),
    "cfg below one": ("backbone: {cfg_scale: 0.5}", "backbone.cfg_scale", "minimum"),
    "lora rank zero": ("backbone: {lora: {rank: 0}}", "backbone.lora.rank", "minimum"),
    "lora dropout": ("backbone: {lora: {dropout: 0.3}}", "backbone.lora.dropout", "ratio"),
    "dtype": ("backbone: {dtype: float8}", "backbone.dtype", "not one of"),
    # file structure
    "unknown section": ("samplr: {num_steps: 4}", "samplr", "unknown key"),
    "unknown key": ("train: {learning_rate: 0.1}", "train.learning_rate", "unknown key"),
    "duplicated section": (
        "sampler: {num_steps: 12}\ntrain: {lr: 0.001}\nsampler: {group_size: 4}",
        "sampler",
        "duplicate key",
    ),
    "duplicated nested key": ("train:\n  lr: 0.001\n  lr: 0.01", "'lr'", "line 2"),
    "tracking backend": ("tracking: {backend: wandb}", "tracking.backend", "not one of"),
    "tracking experiment empty": (
        "tracking: {mlflow_experiment: ''}",
        "tracking.mlflow_experiment",
        "empty",
    ),
    "old mlflow experiment key": (
        "tracking: {experiment: x}",
        "tracking.experiment",
        "experiment is now tracking.mlflow_experiment",
    ),
}


def test_the_table_is_large_and_distinct():
    assert len(BAD) >= 45
    assert len({text for text, _, _ in BAD.values()}) == len(BAD)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_config_is_refused_naming_the_file_and_key(name, tmp_path):
    text, key, says = BAD[name]
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert str(path) in message, message
    assert re.search(rf"(^|\W){re.escape(key)}(\W|$)", message), message
    assert says in message, message


def test_numbers_written_like_1e_4_are_numbers(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("train: {lr: 1e-4, weight_decay: 1E-2}\nadvantage: {eps: 1e-6}\n")
    config = load_config(path)
    assert (config.train.lr, config.train.weight_decay, config.advantage.eps) == (1e-4, 1e-2, 1e-6)


def test_set_overrides_are_blamed_on_the_override_not_the_file(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("train: {lr: 0.001}\n")
    with pytest.raises(ConfigError, match=r"--set train\.lr=-1: train\.lr"):
        load_config(path, ["train.lr=-1"])


# Valid together, each invalid with the defaults of the others (8 segment steps, window 4).
TOGETHER = ["sampler.num_steps=2", "sampler.segment_steps=2", "jagg.window=2"]


@pytest.mark.parametrize("order", itertools.permutations(TOGETHER), ids="|".join)
def test_set_overrides_checked_against_each_other_may_come_in_any_order(tmp_path, order):
    path = tmp_path / "ok.yaml"
    path.write_text("train: {lr: 0.001}\n")
    config = load_config(path, list(order))
    assert (config.sampler.num_steps, config.sampler.segment_steps, config.jagg.window) == (2, 2, 2)


def test_an_invalid_combination_of_set_overrides_names_the_key(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("train: {lr: 0.001}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path, [*TOGETHER[:2], "jagg.window=3"])
    # Blamed: the overrides of the keys the error names (the window, the steps it exceeds).
    message = str(refused.value)
    blamed, _, error = message.partition(": ")
    assert blamed == "--set sampler.segment_steps=2 jagg.window=3", message
    assert error.startswith("jagg.window: 3 is more than the 2 trained steps"), message


def test_the_command_line_refuses_a_bad_config_within_seconds(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("grpo: {clip_range: 0}\n")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "jagg_pipeline", "config", "show", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0 and "grpo.clip_range" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert elapsed < 5, f"{elapsed:.1f} s"
