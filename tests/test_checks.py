"""The checks before any job (jagg_pipeline.workflow.checks): each refusal on hand-made files.

A backbone setting its checkpoint's transformer config cannot honour, a reward model file of
the wrong format (judged by its headers: nothing is loaded), an evaluation of a round its
training run never trains; each one line naming the key, the file and the run. No Snakemake
here (tests/test_hostile_config.py runs the same refusals through ``snakemake -n``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from workflow_helpers import REDUCED

from jagg_pipeline.backbones.loading import BackboneLoadError
from jagg_pipeline.backbones.velocity import VelocityMixin
from jagg_pipeline.cli import main
from jagg_pipeline.config.checkpoints import option_problems
from jagg_pipeline.config.run import REWARD_NAMES, BackboneConfig, RewardsConfig
from jagg_pipeline.rewards.toy_scene import ALL_ATTRIBUTES
from jagg_pipeline.workflow import model_files
from jagg_pipeline.workflow.checks import NO_MODEL_FILES, REWARD_FILES, check_runs
from jagg_pipeline.workflow.experiments import resolve_runs
from jagg_pipeline.workflow.sections import merge, split

PIPELINES = {"sd3": "StableDiffusion3Pipeline", "qwenimage": "QwenImagePipeline"}


def _pipeline(folder: Path, family: str, transformer: dict) -> Path:
    """A pipeline folder as check_pipeline_dir reads it: model_index.json, the transformer's
    config.json (the other components' folders empty)."""
    folder.mkdir(parents=True)
    index = {"_class_name": PIPELINES[family], "transformer": ["diffusers", "X"], "vae": ["d", "V"]}
    (folder / "model_index.json").write_text(json.dumps(index))
    (folder / "vae").mkdir()
    (folder / "transformer").mkdir()
    (folder / "transformer/config.json").write_text(json.dumps(transformer))
    return folder


def _problems(data: dict) -> list[str]:
    return check_runs(resolve_runs(data).values(), split(data)[1])


def _reduced(**sections) -> dict:
    return merge(copy.deepcopy(REDUCED), sections)


# --- backbone settings against the checkpoint's config ---------------------------------------


def test_guidance_scale_is_refused_where_the_transformer_has_no_guidance_embedding():
    spec = BackboneConfig(family="sd3", guidance_scale=3.5)
    (line,) = option_problems(spec, {"in_channels": 16}, "ckpt/transformer/config.json")
    assert line.startswith("backbone.guidance_scale is set (3.5) but this sd3 transformer")
    assert "ckpt/transformer/config.json" in line and "backbone.cfg_scale" in line
    flux = BackboneConfig(family="flux", guidance_scale=3.5)
    assert option_problems(flux, {"guidance_embeds": True}, "f") == []
    assert option_problems(BackboneConfig(family="sd3"), {}, "f") == []


def test_the_load_time_check_is_the_same_declaration():
    """The backbone refuses at load with option_problems' own line (a stand-in backbone: the
    check reads only the transformer's config, the path and the spec)."""
    spec = BackboneConfig(family="qwenimage", guidance_scale=4.0)
    stand_in = SimpleNamespace(
        transformer=SimpleNamespace(config={"guidance_embeds": False}), path=Path("/m/qwen")
    )
    (expected,) = option_problems(spec, {}, "/m/qwen/transformer/config.json")
    with pytest.raises(BackboneLoadError) as caught:
        VelocityMixin._guidance_value(stand_in, spec)
    assert str(caught.value) == expected
    stand_in.transformer.config["guidance_embeds"] = True
    assert VelocityMixin._guidance_value(stand_in, spec) == 4.0
    assert VelocityMixin._guidance_value(stand_in, BackboneConfig(family="flux")) == 3.5


@pytest.mark.parametrize("family", ["sd3", "qwenimage"])
def test_a_cross_entry_inheriting_guidance_is_refused_naming_key_file_and_runs(tmp_path, family):
    checkpoint = _pipeline(tmp_path / family, family, {"guidance_embeds": False})
    data = _reduced(backbone={"guidance_scale": 3.5})
    entry = {"backbone": {"family": family, "path": str(checkpoint)}}
    data["workflow"]["experiments"]["all"]["cross"] = {"bb": {"mine": entry}}
    (line,) = _problems(data)
    assert line.startswith("backbone.guidance_scale is set (3.5)"), line
    assert f"{checkpoint}/transformer/config.json" in line
    assert line.endswith("(runs all/exact/seed-0, all/jagg/seed-0)"), line


def test_a_checkpoint_whose_transformer_config_is_no_json_is_refused(tmp_path):
    checkpoint = _pipeline(tmp_path / "sd3", "sd3", {})
    (checkpoint / "transformer/config.json").write_text("{not json")
    (line,) = _problems(_reduced(backbone={"path": str(checkpoint)}))
    assert line.startswith(f"backbone.path='{checkpoint}': {checkpoint}/transformer/config.json")
    assert "not readable JSON" in line


# --- reward model files, by their headers -----------------------------------------------------


def test_every_string_setting_of_every_reward_is_known_to_the_checks():
    """A new reward (or setting) names its model files in REWARD_FILES, or none."""
    named = {reward for reward, _ in REWARD_FILES}
    assert named | NO_MODEL_FILES == set(REWARD_NAMES) and not named & NO_MODEL_FILES
    for name in REWARD_NAMES:
        spec = getattr(RewardsConfig(), name)
        settings = {
            f.name
            for f in dataclasses.fields(spec)
            if f.name != "dtype" and isinstance(getattr(spec, f.name), str | None)
        }
        assert settings == {s for r, s in REWARD_FILES if r == name}, name


def _torch_file(path: Path, value: object, zip_format: bool = True) -> Path:
    torch.save(value, path, _use_new_zipfile_serialization=zip_format)
    return path


HPS_KEYS = ("state_dict", "logit_scale")


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_a_torch_checkpoint_is_read_by_its_pickle_without_loading_it(tmp_path, zip_format):
    state = {"logit_scale": torch.ones(()), "visual.proj": torch.zeros(2, 2)}
    good = _torch_file(tmp_path / "hps.pt", {"state_dict": state}, zip_format)
    assert model_files.torch_checkpoint_problem(good, HPS_KEYS) is None
    other = _torch_file(tmp_path / "other.pt", {"model": {"w": torch.zeros(2)}}, zip_format)
    problem = model_files.torch_checkpoint_problem(other, HPS_KEYS)
    assert problem == (
        f"{other} is a torch checkpoint without 'state_dict', 'logit_scale': not the model it "
        "should hold"
    )


def test_what_is_no_torch_checkpoint_is_named_so(tmp_path):
    text = tmp_path / "HPS_v2.1_compressed.pt"
    text.write_text("version https://git-lfs.github.com/spec/v1\n")  # an LFS pointer
    assert "is not a torch checkpoint (neither a zip archive nor a pickle" in (
        model_files.torch_checkpoint_problem(text)
    )
    tensors = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(3)}, str(tensors))
    assert model_files.torch_checkpoint_problem(tensors) == (
        f"{tensors} is a safetensors file, not a torch checkpoint (torch.save)"
    )
    archive = tmp_path / "some.zip"
    with zipfile.ZipFile(archive, "w") as out:
        out.writestr("readme.txt", "hello")
    assert "no torch checkpoint (no one */data.pkl" in model_files.torch_checkpoint_problem(archive)
    truncated = tmp_path / "cut.pt"
    whole = _torch_file(tmp_path / "whole.pt", {"state_dict": {"w": torch.zeros(64)}}).read_bytes()
    truncated.write_bytes(whole[: len(whole) // 2])
    assert "not a readable zip archive" in model_files.torch_checkpoint_problem(truncated)


def test_a_safetensors_header_is_checked_against_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(64)}, str(path))
    assert model_files.safetensors_problem(path) is None
    whole = path.read_bytes()
    path.write_bytes(whole[:-16])
    assert "is truncated: its header announces 256 bytes of tensors" in (
        model_files.safetensors_problem(path)
    )
    path.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    assert model_files.safetensors_problem(path).endswith("(its header is not JSON)")
    path.write_text("hello world, no tensors here")
    assert "not a safetensors file (no header" in model_files.safetensors_problem(path)


def _clip_folder(folder: Path, model_type: str = "clip") -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    (folder / "processor_config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_a_transformers_folder_is_checked_by_its_config_and_weight_files(tmp_path):
    good = _clip_folder(tmp_path / "clip")
    assert model_files.hf_model_problem(good, "clip") is None
    assert model_files.hf_processor_problem(good) is None
    bert = _clip_folder(tmp_path / "bert", "bert")
    assert model_files.hf_model_problem(bert, "clip") == (
        f"{bert}/config.json describes a 'bert' model, not a 'clip' one"
    )
    (good / "model.safetensors").unlink()
    assert "holds no weights (model.safetensors, " in model_files.hf_model_problem(good, "clip")
    (good / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "a.st"}}))
    assert model_files.hf_model_problem(good, "clip") == (
        f"{good}/model.safetensors.index.json lists {good}/a.st, which is missing"
    )
    (good / "tokenizer.json").unlink()
    assert "holds no tokenizer (tokenizer.json or vocab.json + merges.txt" in (
        model_files.hf_processor_problem(good)
    )
    assert model_files.hf_model_problem(tmp_path, "clip").endswith(
        "not found: no saved transformers model"
    )


def test_the_reward_models_a_run_uses_are_checked_and_hub_ids_are_not(tmp_path):
    text = tmp_path / "hps.pt"
    text.write_text("not a checkpoint")
    clip = _clip_folder(tmp_path / "clip")
    data = _reduced(
        eval={"metrics": ["hpsv21", "clipscore", "pickscore"]},
        rewards={
            "hpsv21": {"checkpoint": str(text)},
            "clipscore": {"model": str(clip)},  # its processor (null): the model's folder
            "pickscore": {"model": "nobody/not-cached", "processor": str(tmp_path / "gone")},
        },
    )
    problems = _problems(data)
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"rewards.hpsv21.checkpoint='{text}': {text} is not a torch")
    assert problems[1].startswith(f"rewards.pickscore.processor: {tmp_path / 'gone'} not found")
    for line in problems:
        assert line.endswith("(runs all/exact/seed-0, all/jagg/seed-0)"), line
    (clip / "tokenizer.json").unlink()
    assert "rewards.clipscore.model (rewards.clipscore.processor is null)" in _problems(data)[1]


def test_an_evaluation_run_is_checked_for_its_metrics_only(tmp_path):
    bad = tmp_path / "hps.pt"
    bad.write_text("no")
    data = _reduced(rewards={"weights": {"hpsv21": 1.0}, "hpsv21": {"checkpoint": str(bad)}})
    data["workflow"]["experiments"] = {}
    data["workflow"]["evaluations"] = {"check": {"policies": {"base": {}}}}
    assert _problems(data) == []


# --- evaluated rounds -------------------------------------------------------------------------


def _evaluating(checkpoint: str) -> dict:
    data = _reduced()
    policies = {"base": {}, "late": {"checkpoint": checkpoint}}
    data["workflow"]["evaluations"] = {"check": {"policies": policies}}
    return data


def test_an_evaluated_round_past_train_rounds_is_refused_naming_the_evaluation_and_run():
    (line,) = _problems(_evaluating("results/all/jagg/seed-0/round-0005/checkpoint"))
    assert line == (
        "workflow.evaluations.check.policies.late.checkpoint: "
        "'results/all/jagg/seed-0/round-0005/checkpoint' is round 5 of all/jagg/seed-0, which "
        "trains rounds 0 to 1 (its train.rounds is 2): the workflow would train it 4 round(s) "
        "further to make it; name one of its rounds (run check/late/seed-1234)"
    )


@pytest.mark.parametrize(
    "checkpoint",
    ["results/all/jagg/seed-0/round-0001/checkpoint", "elsewhere/round-0009/checkpoint"],
)
def test_a_trained_round_or_a_checkpoint_of_no_run_here_passes(checkpoint):
    assert _problems(_evaluating(checkpoint)) == []


# --- config check reports the same ------------------------------------------------------------


def test_config_check_reports_what_the_workflow_refuses(tmp_path, capsys):
    import yaml

    checkpoint = _pipeline(tmp_path / "sd3", "sd3", {})
    bad = tmp_path / "hps.pt"
    bad.write_text("no")
    data = _evaluating("results/all/exact/seed-0/round-0002/checkpoint")
    data = merge(
        data,
        {
            "backbone": {"path": str(checkpoint), "guidance_scale": 3.5},
            "eval": {"metrics": ["hpsv21"]},
            "rewards": {"hpsv21": {"checkpoint": str(bad)}},
        },
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["config", "check", "--config", str(path)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {path}: {problem}" for problem in _problems(data)]
    assert len(errors) == 3, errors


# --- prompts a toy reward scores ---------------------------------------------------------------

TOY = [a.caption() for a in ALL_ATTRIBUTES[:5]]


def test_a_training_prompt_that_is_no_toy_caption_is_refused_naming_file_line_and_fix(tmp_path):
    prompts = tmp_path / "mine.txt"
    prompts.write_text(f"{TOY[0]}\n\n{TOY[1]}\na photo of a cat\n{TOY[2]}\n")
    (line,) = _problems(_reduced(sampler={"prompts": str(prompts)}))
    assert line == (
        f"sampler.prompts: {prompts}: line 4, 'a photo of a cat', is not a toy-world caption, "
        "and toy_attributes in rewards.weights scores only those; put a real reward model in "
        "rewards.weights, or use toy captions (such as 'a red circle on the left, white "
        "background', or the sets toy:train / toy:heldout) (runs all/exact/seed-0, "
        "all/jagg/seed-0)"
    )
    # Scored by a reward that reads any prompt, the same file passes.
    jpeg = {"weights": {"jpeg_compressibility": 1.0}}
    assert _problems(_reduced(sampler={"prompts": str(prompts)}, rewards=jpeg)) == []


def test_evaluation_prompts_are_parsed_as_far_as_eval_max_prompts_under_a_toy_metric(tmp_path):
    prompts = tmp_path / "eval.csv"
    prompts.write_text("prompt\n" + "".join(f'"{p}"\n' for p in TOY[:4]) + "a dog\n")
    data = _reduced(eval={"prompts": str(prompts)})  # max_prompts 4: the dog is not scored
    assert _problems(data) == []
    (line,) = _problems(merge(data, {"eval": {"max_prompts": 5}}))
    assert line.startswith(f"eval.prompts: {prompts}: prompt 5, 'a dog', is not a toy-world")
    assert "toy_attributes in eval.metrics scores only those" in line
    assert _problems(merge(data, {"eval": {"max_prompts": 5, "metrics": ["toy_clipscore"]}})) == []


def test_toy_captions_in_a_file_of_ones_own_pass(tmp_path):
    prompts = tmp_path / "toy.jsonl"
    prompts.write_text("".join(json.dumps({"caption": f"  {p}"}) + "\n" for p in TOY))
    source = {"prompts": str(prompts)}
    data = _reduced(
        sampler={**source, "prompt_column": "caption"}, eval={**source, "column": "caption"}
    )
    assert _problems(data) == []


def test_config_check_parses_a_toy_scored_prompt_file_without_torch(tmp_path):
    import subprocess
    import sys

    import yaml

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([*TOY, "a cat"]) + "\n")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_reduced(sampler={"prompts": str(prompts)})))
    code = (
        "import sys\n"
        "from jagg_pipeline.cli import main\n"
        f"code = main(['config', 'check', '--config', {str(path)!r}])\n"
        "assert 'torch' not in sys.modules, 'torch imported by config check'\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    assert f"sampler.prompts: {prompts}: line 6, 'a cat'," in done.stderr
