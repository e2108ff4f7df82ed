"""Backbone adapters on tiny Flux / SD3 / QwenImage checkpoints built offline in the real formats.

Each checkpoint is a random tiny diffusers pipeline saved with ``save_pretrained``; the
adapters load it ONLY from disk, and the in-memory pipeline is the reference.
"""

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from jagg_pipeline.backbones import (
    BackboneConfig,
    BackboneLoadError,
    LoraConfig,
    load_backbone,
)
from jagg_pipeline.bench.gradcheck import GradcheckConfig, run_gradcheck
from jagg_pipeline.cli import main
from jagg_pipeline.core import jagg, sde
from jagg_pipeline.core.objective import GRPOStepLoss, recompute_log_probs
from jagg_pipeline.toyworld.tiny import (
    TINY_FAMILIES,
    TINY_IMAGE_SIZE,
    build_tiny_pipeline,
    qwen2_tokenizer,
    toy_captions,
)

PROMPTS = ["a red circle on the left, white background", "a blue square at the top"]
STEPS = 4
TOKENS = 16
FLUX_GUIDANCE = 2.5
UNITS = {"flux": 2, "sd3": 2, "qwenimage": 2}  # blocks of the tiny configs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (the in-memory reference pipeline, the directory it was saved to)."""
    built = {}
    for family in TINY_FAMILIES:
        pipeline = build_tiny_pipeline(family)
        pipeline.set_progress_bar_config(disable=True)
        path = tmp_path_factory.mktemp(family)
        pipeline.save_pretrained(path)
        built[family] = (pipeline, path)
    return built


def load(checkpoints, family, **options):
    settings = {
        "height": TINY_IMAGE_SIZE,
        "width": TINY_IMAGE_SIZE,
        "dtype": "float32",
        "max_sequence_length": TOKENS,
        "training": "full",
        **({"guidance_scale": FLUX_GUIDANCE} if family == "flux" else {}),
        **options,
    }
    return load_backbone(BackboneConfig(family, str(checkpoints[family][1]), **settings))


def run_pipeline(pipeline, family, cfg, output_type):
    """The official pipeline on PROMPTS with seed 0, guided like the adapter."""
    negative = {"negative_prompt": ""} if cfg > 1 else {}
    guidance = {
        "flux": {"guidance_scale": FLUX_GUIDANCE, "true_cfg_scale": cfg, **negative},
        "sd3": {"guidance_scale": cfg},
        "qwenimage": {"true_cfg_scale": cfg, **negative},
    }[family]
    return pipeline(
        PROMPTS,
        height=TINY_IMAGE_SIZE,
        width=TINY_IMAGE_SIZE,
        num_inference_steps=STEPS,
        max_sequence_length=TOKENS,
        generator=torch.Generator().manual_seed(0),
        output_type=output_type,
        **guidance,
    ).images


def ode_masks(steps):
    none = torch.zeros(steps, dtype=torch.bool)
    return sde.StepMasks(sde=none, train=none.clone())


@pytest.mark.parametrize("cfg", [1.0, 2.0])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_ode_sampler_reproduces_the_official_pipeline(checkpoints, family, cfg):
    pipeline, _ = checkpoints[family]
    backbone = load(checkpoints, family, cfg_scale=cfg)
    reference = run_pipeline(pipeline, family, cfg, "latent")

    sigmas = backbone.sigmas(STEPS)
    assert torch.equal(sigmas, pipeline.scheduler.sigmas)  # the pipeline's own schedule
    cond = backbone.encode_prompts(PROMPTS)
    noise = backbone.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    ode = sde.StepCoefficients("ode", 0.0)
    latents = sde.sample(backbone.velocity, cond, noise, sigmas, ode_masks(STEPS), ode).latents
    assert latents.shape[2:] == reference.shape[1:] == backbone.latent_shape
    torch.testing.assert_close(latents[:, -1], reference, rtol=1e-5, atol=1e-5)
    # Every convention matters: the latents move far from the noise along the way.
    assert (reference - noise).abs().max() > 0.5

    if cfg == 1.0:
        images = run_pipeline(pipeline, family, cfg, "pt")
        decoded = backbone.decode(latents[:, -1])
        assert decoded.shape == (len(PROMPTS), 3, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE)
        torch.testing.assert_close(decoded, images, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [1.0, 2.0])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_bf16_ode_sampler_reproduces_the_official_pipeline(checkpoints, family, cfg):
    """In bf16 every rounding the pipeline makes matters: timestep, Euler update."""
    _, path = checkpoints[family]
    pipeline = type(checkpoints[family][0]).from_pretrained(path, torch_dtype=torch.bfloat16)
    pipeline.set_progress_bar_config(disable=True)
    backbone = load(checkpoints, family, cfg_scale=cfg, dtype="bfloat16")
    reference = run_pipeline(pipeline, family, cfg, "latent")
    cond = backbone.encode_prompts(PROMPTS)
    noise = backbone.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    ode = sde.StepCoefficients("ode", 0.0)
    sigmas = backbone.sigmas(STEPS)
    latents = sde.sample(backbone.velocity, cond, noise, sigmas, ode_masks(STEPS), ode).latents
    assert latents.dtype == reference.dtype == torch.bfloat16
    if family == "qwenimage" and cfg > 1:
        # The pipeline runs cond and uncond as two forwards of their own text lengths; the
        # adapter batches them (padded, masked): 7% of the elements round differently, by at
        # most one bf16 ulp at |x| < 4 (1/64); the fp32 test above shows the maths agree.
        assert (latents[:, -1].float() - reference.float()).abs().max() <= 2 / 64
    else:
        assert torch.equal(latents[:, -1], reference)


def test_qwenimage_schedule_ends_at_its_shift_terminal(checkpoints):
    sigmas = load(checkpoints, "qwenimage").sigmas(STEPS)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert sigmas[-2].item() == pytest.approx(0.02)


def rollout(backbone, seed=1):
    """An SDE (Flow-GRPO) rollout of PROMPTS and the GRPO objective factory on it."""
    gen = torch.Generator().manual_seed(seed)
    cond = backbone.encode_prompts(PROMPTS)
    sigmas = backbone.sigmas(STEPS)
    masks = sde.full_trajectory_masks(STEPS)
    coeffs = sde.StepCoefficients("flow_grpo", 0.7)
    noise = backbone.initial_noise(len(PROMPTS), gen)
    traj = sde.sample(backbone.velocity, cond, noise, sigmas, masks, coeffs, gen)
    steps = masks.trained_indices
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)

    def objective():
        return GRPOStepLoss(traj.latents, sigmas, traj.log_probs, advantages, steps, coeffs, 1e-4)

    return traj, cond, steps, coeffs, objective


def grpo_gradient(backbone, traj, cond, steps, objective, mode):
    batch = jagg.MicroBatch(traj.latents, traj.sigmas, cond, objective())
    return jagg.trajectory_gradient(backbone.velocity, batch, steps, window=2, mode=mode)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_sde_rollout_ratio_is_one_and_jagg_equals_exact_at_w2(checkpoints, family):
    backbone = load(checkpoints, family, cfg_scale=2.0)
    traj, cond, steps, coeffs, objective = rollout(backbone)
    assert traj.log_probs[:, steps].abs().min() > 0
    recomputed = recompute_log_probs(
        backbone.velocity, traj.latents, traj.sigmas, cond, steps, coeffs
    )
    assert torch.equal(recomputed, traj.log_probs[:, steps])  # ratio == 1 exactly

    params = backbone.trainable_parameters()
    grads = {
        mode: jagg.collect_gradient(
            params, lambda mode=mode: grpo_gradient(backbone, traj, cond, steps, objective, mode)
        )
        for mode in ("exact", "jagg")
    }
    assert grads["exact"].norm() > 0
    assert jagg.agreement(grads["jagg"], grads["exact"]).rel_err < 1e-5

    # One jagg optimiser step: every trainable parameter gets a gradient, the policy moves.
    z, sigma = traj.latents[:, 1], traj.sigmas[1].expand(2)
    before = backbone.velocity(z, sigma, cond).detach()
    stats = grpo_gradient(backbone, traj, cond, steps, objective, "jagg")
    # Windows [0, 1] and [2]: the sequential endpoint backward (the default) calls backward
    # once per endpoint of the first, once for the one-step window.
    assert stats.backward_calls == 2 + 1
    assert [
        n for n, p in backbone.transformer.named_parameters() if p.requires_grad and p.grad is None
    ] == []
    torch.optim.SGD(params, lr=1e-2).step()
    assert not torch.allclose(backbone.velocity(z, sigma, cond), before)


def test_qwenimage_last_block_text_stream_gets_no_gradient_and_stays_frozen(checkpoints):
    backbone = load(checkpoints, "qwenimage")
    dead = [
        p
        for prefix in backbone.dead_modules()
        for p in backbone.transformer.get_submodule(prefix).parameters()
    ]
    assert dead and not any(p.requires_grad for p in dead)
    assert not any(p is q for p in backbone.trainable_parameters() for q in dead)
    for p in dead:  # unfreeze them: they really receive nothing, while the rest all do
        p.requires_grad_(True)
    cond = backbone.encode_prompts(PROMPTS)
    z = backbone.initial_noise(2, torch.Generator().manual_seed(0))
    backbone.velocity(z, torch.full((2,), 0.5), cond).square().mean().backward()
    assert all(p.grad is None for p in dead)
    live = [p for p in backbone.transformer.parameters() if not any(p is q for q in dead)]
    assert all(p.grad is not None for p in live)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_lora_trains_only_adapters_and_round_trips(checkpoints, family, tmp_path):
    settings = LoraConfig(rank=4)
    backbone = load(checkpoints, family, training="lora", lora=settings)
    names = [n for n, p in backbone.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert not any(n.startswith(tuple(backbone.dead_modules())) for n in names)
    base = {n: p.detach().clone() for n, p in backbone.transformer.named_parameters()}

    traj, cond, steps, _, objective = rollout(backbone)
    z, sigma = traj.latents[:, 1], traj.sigmas[1].expand(2)
    untrained = backbone.velocity(z, sigma, cond).detach()
    optimiser = torch.optim.Adam(backbone.trainable_parameters(), lr=1e-2)
    for mode in ("exact", "jagg"):
        optimiser.zero_grad()
        grpo_gradient(backbone, traj, cond, steps, objective, mode)
        assert all(p.grad is not None for p in backbone.trainable_parameters())
        optimiser.step()
    after = dict(backbone.transformer.named_parameters())
    changed = {n for n, p in after.items() if not torch.equal(p, base[n])}
    assert changed and all("lora_" in n for n in changed)
    trained = backbone.velocity(z, sigma, cond).detach()
    assert not torch.allclose(trained, untrained)

    saved = backbone.save_lora(tmp_path / "adapter")
    assert sorted(f.name for f in saved.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "pytorch_lora_weights.safetensors",
    ]
    weights = load_file(str(saved / "adapter_model.safetensors"))
    assert weights and all(k.startswith("base_model.model.") and "lora_" in k for k in weights)
    assert sum(w.numel() for w in weights.values()) < 0.5 * sum(v.numel() for v in base.values())
    adapted = sorted({k.removeprefix("base_model.model.").split(".lora_")[0] for k in weights})
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["target_modules"] == adapted  # the layers themselves, never peft's suffixes

    # Where users load adapters: diffusers' load_lora_weights and peft's PeftModel, onto the
    # base pipeline's transformer, give the trained velocities.
    for loader in (_diffusers_lora, _peft_lora):
        plain = load(checkpoints, family)
        plain.transformer = loader(checkpoints[family][1], saved)
        velocity = plain.velocity(z, sigma, cond)
        assert not torch.allclose(velocity, untrained), loader.__name__
        torch.testing.assert_close(velocity, trained, rtol=1e-5, atol=1e-6)

    for training in ("lora", "full"):  # into fresh adapters, or injected into a plain model
        fresh = load(checkpoints, family, training=training, lora=settings)
        torch.testing.assert_close(fresh.velocity(z, sigma, cond), untrained)
        fresh.load_lora(saved)
        assert torch.equal(fresh.velocity(z, sigma, cond), trained)
        assert all("lora_" in n for n, p in fresh.transformer.named_parameters() if p.requires_grad)


def _diffusers_lora(checkpoint, adapter):
    """The checkpoint's transformer with ``adapter`` loaded by the pipeline's load_lora_weights."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(checkpoint)).to(torch.float32)
    pipe.load_lora_weights(str(adapter))
    return pipe.transformer.eval()


def _peft_lora(checkpoint, adapter):
    """The checkpoint's transformer with ``adapter`` loaded by peft's PeftModel."""
    from diffusers import DiffusionPipeline
    from peft import PeftModel

    transformer = DiffusionPipeline.from_pretrained(str(checkpoint)).transformer.to(torch.float32)
    PeftModel.from_pretrained(transformer, str(adapter))  # injects into transformer in place
    return transformer.eval()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_fsdp_units_and_activation_checkpointing(checkpoints, family):
    backbone = load(checkpoints, family)
    units = backbone.fsdp_units()
    assert len(units) == UNITS[family]
    assert all(type(u).__name__ in backbone.transformer._no_split_modules for u in units)

    cond = backbone.encode_prompts(PROMPTS)
    z = backbone.initial_noise(2, torch.Generator().manual_seed(0))
    sigma = torch.full((2,), 0.7)
    params = backbone.trainable_parameters()
    calls = []
    forward = units[0].forward

    def counted(*args, **kwargs):  # a forward hook would miss checkpointing's re-run
        calls.append(1)
        return forward(*args, **kwargs)

    units[0].forward = counted

    def gradient():
        calls.clear()
        return jagg.collect_gradient(
            params, lambda: backbone.velocity(z, sigma, cond).square().mean().backward()
        )

    plain = gradient()
    assert len(calls) == 1
    backbone.set_gradient_checkpointing(True)
    checkpointed = gradient()
    assert len(calls) == 2  # the block ran again in backward
    torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-7)


def test_cached_conditioning_drives_a_backbone_without_text_encoders(checkpoints, tmp_path):
    full = load(checkpoints, "flux", cfg_scale=2.0)
    save_file(full.encode_prompts(PROMPTS), str(tmp_path / "cond.safetensors"))
    cached = load_file(str(tmp_path / "cond.safetensors"))
    light = load(checkpoints, "flux", cfg_scale=2.0, load_text_encoders=False)
    assert light.text == {}
    with pytest.raises(RuntimeError, match="load_text_encoders"):
        light.encode_prompts(PROMPTS)
    z = full.initial_noise(2, torch.Generator().manual_seed(0))
    sigma = torch.full((2,), 0.5)
    expected = full.velocity(z, sigma, full.encode_prompts(PROMPTS))
    assert torch.equal(light.velocity(z, sigma, cached), expected)
    no_cfg = {k: v for k, v in cached.items() if not k.startswith("negative_")}
    with pytest.raises(KeyError, match="cfg_scale"):
        light.velocity(z, sigma, no_cfg)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/nonexistent/models/flux-dev", "no such local directory"),
        ("nobody-has/this-model", "not in the local cache"),
    ],
)
def test_a_missing_checkpoint_fails_fast_naming_the_key(path, message):
    start = time.monotonic()
    with pytest.raises(BackboneLoadError, match=message) as error:
        load_backbone(BackboneConfig("flux", path, key="policy.backbone"))
    assert time.monotonic() - start < 5
    assert "policy.backbone.path" in str(error.value)


def test_wrong_checkpoints_give_clear_errors(checkpoints, tmp_path):
    with pytest.raises(BackboneLoadError, match=r"model_index\.json not found"):
        load_backbone(BackboneConfig("sd3", str(tmp_path)))
    with pytest.raises(BackboneLoadError, match=r"FluxPipeline.*backbone\.family='sd3'"):
        load_backbone(BackboneConfig("sd3", str(checkpoints["flux"][1])))
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(checkpoints["sd3"][1] / "model_index.json", partial)
    with pytest.raises(BackboneLoadError, match="incomplete download"):
        load_backbone(BackboneConfig("sd3", str(partial)))
    with pytest.raises(ValueError, match=r"no guidance embedding.*backbone\.cfg_scale"):
        load(checkpoints, "sd3", guidance_scale=3.0)
    with pytest.raises(ValueError, match=r"backbone\.height: 30 is not a multiple of 16"):
        load(checkpoints, "flux", height=30)
    with pytest.raises(ValueError, match="unknown backbone family"):
        load_backbone(BackboneConfig("unet", str(tmp_path)))


def test_qwenimage_rejects_a_tokenizer_that_misplaces_the_template_cut(checkpoints, tmp_path):
    copy = tmp_path / "qwen"
    shutil.copytree(checkpoints["qwenimage"][1], copy)
    shutil.rmtree(copy / "tokenizer")
    qwen2_tokenizer(corpus=toy_captions()).save_pretrained(copy / "tokenizer")
    with pytest.raises(ValueError, match="not 34"):
        load_backbone(BackboneConfig("qwenimage", str(copy), height=32, width=32, dtype="float32"))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_gradcheck_runs_on_tiny_backbones(family):
    settings = GradcheckConfig(
        backbone=f"tiny-{family}", window=2, num_steps=4, batch=2, endpoint_backward="joint"
    )
    report = run_gradcheck(settings)
    assert set(report) == {
        "settings",
        "sigmas",
        "trained_steps",
        "windows",
        "backward_calls",
        "trajectory",
        "shared",
    }
    assert report["backward_calls"] == {"exact": 3, "jagg": 2, "no_interp": 2}
    # Shared anchors at W = 2: every step an anchor, the whole run one backward call.
    assert report["shared"]["backward_calls"] == {"exact": 3, "jagg": 1, "no_interp": 1}
    for layout in (report, report["shared"]):
        assert all(w["jagg"]["rel_err"] < 1e-10 for w in layout["windows"])
    assert report["sigmas"][-2] < report["sigmas"][0] == 1.0


def test_gradcheck_cli_accepts_a_tiny_backbone(tmp_path, capsys):
    report = tmp_path / "report.json"
    argv = ["gradcheck", "--backbone", "tiny-qwenimage", "--window", "2", "--steps", "4"]
    assert main([*argv, "--batch", "2", "--json", str(report), "--max-rel-err", "1e-10"]) == 0
    assert "OK: worst window" in capsys.readouterr().out
    assert json.loads(report.read_text())["settings"]["backbone"] == "tiny-qwenimage"


def test_a_hub_id_resolves_through_the_local_hub_cache(checkpoints, tmp_path, monkeypatch):
    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-flux"
    shutil.copytree(checkpoints["flux"][1], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    spec = BackboneConfig("flux", "tiny-org/tiny-flux", height=32, width=32, dtype="float32")
    backbone = load_backbone(spec)
    assert backbone.path == repo / "snapshots" / commit
    reference = load(checkpoints, "flux", max_sequence_length=None, guidance_scale=None)
    cond = reference.encode_prompts(PROMPTS)
    z = reference.initial_noise(2, torch.Generator().manual_seed(0))
    sigma = torch.full((2,), 0.5)
    assert torch.equal(backbone.velocity(z, sigma, cond), reference.velocity(z, sigma, cond))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_an_adapter_with_dropout_samples_deterministically(checkpoints, family, tmp_path):
    """A LoRA adapter saved with dropout 0.3 (a user's adapter): its Dropout modules stay in
    eval mode, so two rollouts of the loaded policy are byte-identical. (peft injects adapter
    modules in training mode, after the backbone was put in eval mode.)"""
    trained = load(checkpoints, family, training="lora", lora=LoraConfig(rank=4))
    with torch.no_grad():  # a non-zero B, so that dropout on the adapter input would show
        for name, param in trained.transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    saved = trained.save_lora(tmp_path / "adapter")
    config_file = saved / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config | {"lora_dropout": 0.3}))
    for training, settings in [("lora", LoraConfig(rank=4)), ("full", None)]:
        backbone = load(checkpoints, family, training=training, lora=settings or LoraConfig())
        backbone.load_lora(saved)
        dropouts = [m for m in backbone.transformer.modules() if isinstance(m, torch.nn.Dropout)]
        assert not any(m.training for m in dropouts)
        # Injected from the file (a full backbone): the file's dropout; loaded into adapters
        # made from the config (which refuses dropout): the config's.
        assert any(m.p == 0.3 for m in dropouts) == (training == "full")
        first, second = rollout(backbone)[0], rollout(backbone)[0]
        assert torch.equal(first.latents, second.latents)
        assert torch.equal(first.log_probs, second.log_probs)


def test_fresh_adapters_are_in_eval_mode(checkpoints):
    backbone = load(checkpoints, "sd3", training="lora", lora=LoraConfig(rank=4))
    assert not any(m.training for m in backbone.transformer.modules())


def test_lora_dropout_is_refused_naming_the_key_and_the_reason():
    with pytest.raises(ValueError, match=r"backbone\.lora\.dropout.*on-policy ratio"):
        LoraConfig(dropout=0.3)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_bf16_compute_equals_fsdp2_mixed_precision(checkpoints, family):
    """Rollout and evaluation under mixed_precision bf16 compute what training computes under
    FSDP2's bf16 policy: bit for bit, so the on-policy ratio is 1."""
    from jagg_pipeline.stages import distributed

    sampler, trainer = load(checkpoints, family), load(checkpoints, family)
    traj, cond, _, _, _ = rollout(sampler)
    z, sigma = traj.latents[:, 2], traj.sigmas[2].expand(len(PROMPTS))
    with torch.no_grad():
        full = sampler.velocity(z, sigma, cond)
        sampler.compute_in_bf16()
        cast = sampler.velocity(z, sigma, cond)
    with distributed.distributed("cpu") as ctx:
        distributed.shard_backbone(trainer, ctx, mixed_precision=True)
        with torch.no_grad():
            sharded = trainer.velocity(z, sigma, cond)
    assert cast.dtype == sharded.dtype == torch.bfloat16
    assert torch.equal(cast, sharded)
    # ... and measurably not what float32 computes (the velocities the rollout stored before).
    assert jagg.velocity_deviation(sharded, full) > jagg.reuse_tolerance(torch.float32)


def test_mixed_precision_over_float16_weights_is_refused_naming_both_keys(checkpoints):
    with pytest.raises(ValueError, match=r"backbone\.mixed_precision.*backbone\.dtype"):
        BackboneConfig("sd3", "x", dtype="float16", mixed_precision="bf16")
