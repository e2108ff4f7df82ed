"""The score stage's memory does not grow with the rollout: it reads images, a chunk at a time.

Two synthetic rollouts of 64 and 512 samples (two shards dealt round-robin, as two ranks write
them) carry big trajectories (latents [B, 11, 16, 48, 48] float32, 1.6 MB a sample, velocities
and conditioning too: about 1 GB at 512 samples) and 256 x 256 images (0.2 MB a sample, 100 MB
at 512). Each is scored by the real stage in a fresh process; the stage's peak RSS (VmHWM,
reset after the imports) must agree between the two sizes within a bound far below what
reading the trajectories (~1 GB more at 512) or holding every image (~90 MB more) would add.
The process runs with a fixed glibc mmap threshold (1 MB): by default glibc raises it after
each freed large block, so later chunk-sized buffers come from the heap, where small live
objects pin them and RSS keeps memory already freed (malloc_trim returns it); fixed, RSS
follows what the stage holds.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from jagg_pipeline.config.run import from_mapping
from jagg_pipeline.io.manifest import finish_output
from jagg_pipeline.io.trajectories import TrajectoryBatch

pytestmark = pytest.mark.slow

STEPS, GROUP, IMAGE = 10, 4, 256
BOUND_MB = 32
CONFIG = {"rewards": {"weights": {"jpeg_compressibility": 1.0}}, "tracking": {"backend": "none"}}

# Runs in a fresh process: import what the stage imports, reset the peak, score, report it.
MEASURE = """
import json, sys
import torch
torch.set_num_threads(1)
from jagg_pipeline.config.run import load_config
from jagg_pipeline.stages.scoring import run_score
import PIL.Image, pyarrow.parquet  # the reward's and the table's imports, loaded lazily

def status(key):
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(key + ":"))

config = load_config(sys.argv[1])
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")  # VmHWM := the current RSS (Linux >= 4.0)
before = status("VmRSS")
scores = run_score(config, sys.argv[2], sys.argv[3], chunk=32)
print(json.dumps({"before_kb": before, "peak_kb": status("VmHWM"), "rows": len(scores.rows)}))
"""


def write_rollout(folder, samples: int, config) -> None:
    """A rollout of ``samples`` samples in two shards (sample i on rank i % 2), with manifest."""
    folder.mkdir()
    prompts = [f"prompt {i}" for i in range(samples // GROUP)]
    for rank in range(2):
        ids = torch.arange(rank, samples, 2)
        n = len(ids)
        gen = torch.Generator().manual_seed(rank)
        TrajectoryBatch(
            latents=torch.zeros(n, STEPS + 1, 16, 48, 48),
            log_probs=torch.zeros(n, STEPS),
            sigmas=torch.linspace(1, 0, STEPS + 1),
            sde_mask=torch.arange(STEPS) < 2,
            train_mask=torch.arange(STEPS) < 2,
            prompt_ids=ids // GROUP,
            group_ids=ids // GROUP,
            seeds=ids.clone(),
            prompts=prompts,
            cond={"prompt_embeds": torch.zeros(n, 64, 256)},
            images=torch.randint(0, 256, (n, 3, IMAGE, IMAGE), generator=gen, dtype=torch.uint8),
            sample_ids=ids,
            velocities=torch.zeros(n, 1, 16, 48, 48),
            velocity_steps=[0],
        ).save(folder, rank=rank)
    finish_output(folder, config, stage="rollout", seeds={"round": 0})


def score_peak_mb(tmp_path, samples: int) -> float:
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(CONFIG))
    rollouts = tmp_path / f"rollout-{samples}"
    write_rollout(rollouts, samples, from_mapping(CONFIG))
    out = tmp_path / f"scores-{samples}"
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(config_file), str(rollouts), str(out)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20)},
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["rows"] == samples
    return (result["peak_kb"] - result["before_kb"]) / 1024


def test_score_peak_rss_is_flat_from_64_to_512_samples(tmp_path):
    small = score_peak_mb(tmp_path, 64)
    large = score_peak_mb(tmp_path, 512)
    print(f"score stage peak above imports: 64 samples {small:.1f} MB, 512 samples {large:.1f} MB")
    assert abs(large - small) < BOUND_MB, (small, large)
