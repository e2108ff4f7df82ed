"""Prompt pools encoded once (the encode stage) and read back by the sampling stages.

The reference is always the inline path: ``encode_prompts`` on the round's prompts with the
text encoders loaded. Built from the pool's rows the conditioning has the same keys, shapes
and dtypes, and the same bits on the tiny Flux and QwenImage and the toy SD3 (one thread).
The SD3 family's CLIPs round a row differently by batch size in float32 on the CPU (so does
the inline path itself from one round's prompts to another's): there the rows are within
1e-6 (measured: at most 2.4e-7 on one thread, 7.2e-7 on two).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from stage_helpers import EVAL_PROMPTS, VARIED_PROMPTS, tiny_checkpoint, write_experiment

from jagg_pipeline.backbones import BackboneConfig, backbone_class, load_backbone
from jagg_pipeline.cli import main
from jagg_pipeline.io.conditioning import (
    CONDITIONING_FILE,
    PROMPTS_FILE,
    ConditioningError,
    PoolConditioning,
    distinct,
    open_conditioning,
    write_conditioning,
)
from jagg_pipeline.io.manifest import ManifestError, read_manifest
from jagg_pipeline.io.prompts import draw_prompts, resolve_prompts
from jagg_pipeline.io.trajectories import load_rollout
from jagg_pipeline.stages.rollout import plan_rollout
from jagg_pipeline.toyworld.models import build_toy_pipeline, toy_backbone_options
from jagg_pipeline.toyworld.tiny import TINY_IMAGE_SIZE, toy_captions

ROOT = Path(__file__).resolve().parents[1]
# A pool with repeats and prompts of very different token counts (QwenImage pads per call).
POOL = [*toy_captions()[:16], *VARIED_PROMPTS, toy_captions()[3], "a"]
BACKBONES = ("tiny-flux", "tiny-sd3", "tiny-qwenimage", "toy-sd3")
# Off by float rounding only (see the module docstring); every other family: bit for bit.
ROUNDED = {"tiny-sd3": 1e-6, "toy-sd3": 1e-6, "tiny-qwenimage": 1e-6}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("checkpoints")
    found = {f"tiny-{f}": tiny_checkpoint(f, base) for f in ("flux", "sd3", "qwenimage")}
    toy = base / "toy-sd3"
    build_toy_pipeline("sd3").save_pretrained(toy)
    return {**found, "toy-sd3": toy}


def spec_of(checkpoints, name, **options) -> BackboneConfig:
    family = name.split("-", 1)[1]
    if name.startswith("toy-"):
        settings = toy_backbone_options(family)
    else:
        settings = {
            "family": family,
            "height": TINY_IMAGE_SIZE,
            "width": TINY_IMAGE_SIZE,
            "dtype": "float32",
            "max_sequence_length": 16,
            "training": "full",
        }
    return BackboneConfig(path=str(checkpoints[name]), **{**settings, **options})


def assert_same(got, reference, tolerance=None):
    assert set(got) == set(reference)
    for key, value in reference.items():
        assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
        if tolerance is None:
            assert torch.equal(got[key], value), key
        else:
            assert (got[key].double() - value.double()).abs().max() <= tolerance, key


@pytest.mark.parametrize("cfg", [1.0, 2.0])
@pytest.mark.parametrize("name", BACKBONES)
def test_conditioning_built_from_the_pool_equals_inline_encoding(tmp_path, checkpoints, name, cfg):
    spec = spec_of(checkpoints, name, cfg_scale=cfg, negative_prompt="blurry, dark")
    text = backbone_class(spec.family).load(spec, text_only=True)
    assert text.transformer is None and text.vae is None and text.text
    pool = distinct(POOL)
    assert len(pool) == len(POOL) - 1
    # Batches of 5: the pool's batches pad differently from each other and from any round.
    write_conditioning(tmp_path, pool, text.encode_pool(pool, 5), text.encode_negative())
    source = PoolConditioning(tmp_path)
    assert len(source) == len(pool)
    assert (tmp_path / PROMPTS_FILE).read_text() == json.dumps(pool, indent=2) + "\n"

    full = load_backbone(spec)
    short = ["green", "a red circle", "green"]  # QwenImage: far shorter than the pool's longest
    rounds = [draw_prompts(pool, 6, seed) for seed in range(3)] + [short]
    for prompts in rounds:
        reference = full.encode_prompts(prompts)
        assert_same(text.encode_prompts(prompts), reference)  # the same text encoders
        assert_same(full.conditioning_from(source, prompts), reference, ROUNDED.get(name))
    if spec.family == "qwenimage" and cfg == 1.0:  # (CFG pads to the negative's length)
        stored = source.rows(short)["prompt_embeds"].shape[1]
        assert stored > full.encode_prompts(short)["prompt_embeds"].shape[1]  # trim mattered

    # A backbone given the pool reads it in encode_prompts, with no text encoder loaded.
    textless = load_backbone(dataclasses.replace(spec, load_text_encoders=False))
    with pytest.raises(RuntimeError, match="load_text_encoders"):
        textless.encode_prompts(short)
    textless.use_precomputed(source)
    assert_same(textless.encode_prompts(short), full.conditioning_from(source, short))


def test_the_reader_refuses_prompts_the_pool_lacks_and_a_pool_without_negative(
    tmp_path, checkpoints
):
    spec = spec_of(checkpoints, "tiny-flux")
    text = backbone_class("flux").load(spec, text_only=True)
    write_conditioning(tmp_path, ["one", "two"], text.encode_pool(["one", "two"], 8), None)
    source = PoolConditioning(tmp_path)
    with pytest.raises(ConditioningError, match=r"prompts\.json: holds no .*'three'"):
        source.rows(["one", "three"])
    with pytest.raises(ConditioningError, match="no negative prompt"):
        source.negative()
    rows = source.rows(["two", "one", "two"])
    assert torch.equal(rows["prompt_embeds"][0], rows["prompt_embeds"][2])
    with pytest.raises(ValueError, match="distinct"):
        write_conditioning(tmp_path, ["one", "one"], iter(()), None)


def test_batches_of_other_lengths_are_padded_to_the_longest_in_their_dtypes(tmp_path):
    embeds = torch.randn(5, 4, 3).to(torch.bfloat16)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]])
    batches = [  # each cut to its own longest, as one encoding call pads
        {"prompt_embeds": embeds[:2, :2], "prompt_embeds_mask": mask[:2, :2]},
        {"prompt_embeds": embeds[2:], "prompt_embeds_mask": mask[2:]},
    ]
    negative = {"prompt_embeds": embeds[:1, :3], "prompt_embeds_mask": mask[:1, :3]}
    prompts = list("abcde")
    write_conditioning(tmp_path, prompts, batches, negative)
    source = PoolConditioning(tmp_path)
    rows = source.rows(["a", "c", "b"])
    padded = embeds.clone()
    padded[:2, 2:] = 0
    assert rows["prompt_embeds"].dtype == torch.bfloat16
    assert torch.equal(rows["prompt_embeds"], padded[[0, 2, 1]])
    assert torch.equal(rows["prompt_embeds_mask"], mask[[0, 2, 1]])
    assert all(torch.equal(source.negative()[k], v) for k, v in negative.items())
    from safetensors.torch import load_file

    stored = load_file(tmp_path / CONDITIONING_FILE)  # a plain safetensors file
    assert sorted(stored) == sorted([*batches[0], *(f"negative_{k}" for k in negative)])
    assert not list(tmp_path.parent.glob(f".{tmp_path.name}.batches-*"))  # staging removed


# --------------------------------------------------------------------------------------------
# The stage: encode once, then rollout and evaluate without text encoders
# --------------------------------------------------------------------------------------------


@pytest.fixture
def loads(monkeypatch):
    """The text components each backbone load returned (None: not loaded), in order."""
    from jagg_pipeline.backbones import base

    calls = []
    original = base.load_components

    def recording(spec, text_components, **kwargs):
        components, path = original(spec, text_components, **kwargs)
        calls.append(
            {
                "text": {name: components.get(name) is not None for name in text_components},
                "transformer": components.get("transformer") is not None,
            }
        )
        return components, path

    monkeypatch.setattr(base, "load_components", recording)
    return calls


def encode_cli(config_file, out, *extra):
    return main(["encode", "--config", str(config_file), "--out", str(out), *extra])


@pytest.mark.parametrize(
    ("family", "sections"),
    [
        ("flux", {}),
        # Variable-length text and negatives: the hardest to get equal.
        ("qwenimage", {"backbone": {"cfg_scale": 2.0, "negative_prompt": "blurry"}}),
    ],
)
def test_rollout_with_an_encoded_pool_is_the_inline_rollout_without_text_encoders(
    tmp_path, checkpoints, loads, family, sections
):
    name = f"tiny-{family}"
    config_file, config = write_experiment(
        tmp_path / "c.yaml", family, checkpoints[name], **sections
    )
    pool = tmp_path / "pool.txt"
    pool.write_text("\n".join(POOL) + "\n")
    encoded = tmp_path / "conditioning"
    assert encode_cli(config_file, encoded, "--prompts", str(pool), "--batch-size", "3") == 0
    text_components = backbone_class(family).text_components
    assert loads == [{"text": dict.fromkeys(text_components, True), "transformer": False}]
    manifest = read_manifest(encoded)
    assert manifest["stage"] == "encode" and manifest["count"] == len(distinct(POOL))
    assert manifest["text"]["backbone.cfg_scale"] == config.backbone.cfg_scale
    assert sorted(manifest["files"]) == sorted([CONDITIONING_FILE, PROMPTS_FILE, "config.yaml"])
    # The staging folder of batches is gone.
    assert sorted(p.name for p in encoded.iterdir()) == sorted(
        [*manifest["files"], "manifest.json", "metrics.jsonl"]
    )
    assert "prompts" in manifest["inputs"]

    base = ["rollout", "--config", str(config_file), "--policy", "base", "--prompts", str(pool)]
    del loads[:]
    assert main([*base, "--out", str(tmp_path / "inline")]) == 0
    assert all(loads[0]["text"].values())
    del loads[:]
    main([*base, "--out", str(tmp_path / "read"), "--conditioning", str(encoded)])
    assert loads and not any(any(call["text"].values()) for call in loads)
    inputs = read_manifest(tmp_path / "read")["inputs"]
    assert inputs["conditioning"]["path"] == str(encoded)

    inline, read = load_rollout(tmp_path / "inline"), load_rollout(tmp_path / "read")
    # The rollout's conditioning is the pool's rows of the round's prompts ...
    plan = plan_rollout(config, resolve_prompts(pool), 0)
    text = backbone_class(family).load(config.backbone, text_only=True)
    built = text.conditioning_from(PoolConditioning(encoded), plan.prompts)
    assert_same(read.cond, {k: v[plan.prompt_ids] for k, v in built.items()})
    # ... and gives the inline rollout: bit for bit where the rows are (see the top).
    assert_same(read.cond, inline.cond, ROUNDED.get(name))
    for field in ("latents", "log_probs", "images"):
        if name in ROUNDED:
            torch.testing.assert_close(
                getattr(read, field).float(), getattr(inline, field).float(), atol=1e-4, rtol=0
            )
        else:
            assert torch.equal(getattr(read, field), getattr(inline, field)), field


def test_a_later_round_reads_the_pool_with_a_checkpoint_policy(tmp_path, checkpoints):
    from jagg_pipeline.io.manifest import write_manifest
    from jagg_pipeline.stages import policy as policies

    config_file, config = write_experiment(tmp_path / "c.yaml", "flux", checkpoints["tiny-flux"])
    checkpoint = tmp_path / "ckpt"
    policies.save_policy(policies.load_policy(config, "base"), checkpoint)
    write_manifest(checkpoint, stage="train", config=config)
    encoded = tmp_path / "conditioning"
    encode_cli(config_file, encoded, "--prompts", "toy:train")
    rollout = ["rollout", "--config", str(config_file), "--policy", str(checkpoint)]
    rollout += ["--prompts", "toy:train", "--round", "1"]
    main([*rollout, "--out", str(tmp_path / "inline")])
    main([*rollout, "--out", str(tmp_path / "read"), "--conditioning", str(encoded)])
    inline, read = load_rollout(tmp_path / "inline"), load_rollout(tmp_path / "read")
    assert torch.equal(read.latents, inline.latents)


def test_evaluate_with_an_encoded_pool_gives_the_inline_metrics(tmp_path, checkpoints, loads):
    config_file, config = write_experiment(tmp_path / "c.yaml", "flux", checkpoints["tiny-flux"])
    encoded = tmp_path / "conditioning"
    encode_cli(config_file, encoded, "--prompts", config.eval.prompts)
    base = ["evaluate", "--config", str(config_file), "--policy", "base"]
    main([*base, "--out", str(tmp_path / "inline")])
    del loads[:]
    main([*base, "--out", str(tmp_path / "read"), "--conditioning", str(encoded)])
    assert loads and not any(any(call["text"].values()) for call in loads)
    metrics = [json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("inline", "read")]
    assert metrics[0] == metrics[1] and metrics[0]["per_prompt"][0]["prompt"] == EVAL_PROMPTS[0]
    for image in sorted((tmp_path / "inline/images").iterdir()):
        assert (tmp_path / "read/images" / image.name).read_bytes() == image.read_bytes()
    assert "conditioning" in read_manifest(tmp_path / "read")["inputs"]


def test_a_pool_encoded_under_other_text_keys_or_changed_is_refused(tmp_path, checkpoints):
    config_file, config = write_experiment(tmp_path / "c.yaml", "flux", checkpoints["tiny-flux"])
    encoded = tmp_path / "conditioning"
    encode_cli(config_file, encoded, "--prompts", "toy:heldout")
    assert len(open_conditioning(encoded, config)) == 39
    # Keys the text encoders never read do not matter ...
    other = dataclasses.replace(config.backbone, device="cpu:0", training="lora")
    open_conditioning(encoded, dataclasses.replace(config, backbone=other))
    # ... those they read do, named.
    for key, value in (("max_sequence_length", 8), ("cfg_scale", 2.0), ("dtype", "bfloat16")):
        changed = dataclasses.replace(config.backbone, **{key: value})
        with pytest.raises(ManifestError, match=rf"conditioning: was encoded with backbone\.{key}"):
            open_conditioning(encoded, dataclasses.replace(config, backbone=changed))
    with pytest.raises(SystemExit, match=r"backbone\.max_sequence_length"):
        main(
            [
                *("rollout", "--config", str(config_file), "--policy", "base"),
                *("--set", "backbone.max_sequence_length=8", "--prompts", "toy:heldout"),
                *("--out", str(tmp_path / "r"), "--conditioning", str(encoded)),
            ]
        )
    with pytest.raises(ConditioningError, match="no such folder"):
        open_conditioning(tmp_path / "missing", config)
    data = bytearray((encoded / CONDITIONING_FILE).read_bytes())
    data[-1] ^= 1
    (encoded / CONDITIONING_FILE).write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=rf"{CONDITIONING_FILE}: corrupt or changed"):
        open_conditioning(encoded, config)


# --------------------------------------------------------------------------------------------
# Memory: a large pool is written one batch at a time and never read whole
# --------------------------------------------------------------------------------------------

ROWS, TOKENS, WIDTH, BATCH = 2048, 32, 1024, 64  # 128 KiB a row, 256 MiB in all


def peak_mib(code: str) -> float:
    """Peak resident memory (VmHWM) of ``code``'s part after ``# measure``, in a fresh process."""
    before, after = code.split("# measure\n")
    script = textwrap.dedent(
        """\
        import re
        def hwm():
            return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
        """
    )
    script += before + "open('/proc/self/clear_refs', 'w').write('5')\nbase = hwm()\n"
    script += after + "print((hwm() - base) / 1024)\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


def test_a_large_pool_is_written_and_read_with_bounded_memory(tmp_path):
    setup = textwrap.dedent(
        f"""\
        import torch
        from jagg_pipeline.io.conditioning import PoolConditioning, write_conditioning
        prompts = [f"prompt {{i}}" for i in range({ROWS})]

        def batches():
            for start in range(0, {ROWS}, {BATCH}):
                rows = torch.arange(start, start + {BATCH}, dtype=torch.float32)
                yield {{
                    "prompt_embeds": rows[:, None, None].expand(-1, {TOKENS}, {WIDTH}).clone(),
                    "pooled": rows[:, None].clone(),
                }}
        """
    )
    written = peak_mib(
        setup + f"# measure\nwrite_conditioning({str(tmp_path)!r}, prompts, batches(), None)\n"
    )
    size = (tmp_path / CONDITIONING_FILE).stat().st_size
    assert size > ROWS * TOKENS * WIDTH * 4
    read = peak_mib(
        setup
        + f"pool = PoolConditioning({str(tmp_path)!r})\n# measure\n"
        + "rows = pool.rows(['prompt 7', 'prompt 2000', 'prompt 8', 'prompt 7'])\n"
        + "assert rows['prompt_embeds'][:, 0, 0].tolist() == [7, 2000, 8, 7], rows\n"
    )
    batch_mib = BATCH * TOKENS * WIDTH * 4 / 2**20  # 8 MiB
    # One batch (and its padded copy) at a time, not the pool's 256 MiB; four rows read.
    print(f"peak MiB: writing {written:.1f}, reading {read:.1f}; file {size / 2**20:.0f} MiB")
    assert written < 8 * batch_mib, (written, size)
    assert read < 2 * batch_mib, read
    assert PoolConditioning(tmp_path).rows(["prompt 5"])["pooled"].tolist() == [[5.0]]
