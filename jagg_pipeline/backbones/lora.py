"""LoRA adapters on a backbone's transformer, through peft: inject, freeze the rest, save, load.

Owns which linear layers receive adapters (the family's target suffixes minus the layers that
cannot influence the output), and the on-disk format of an adapter, one folder that the
ecosystem's loaders read as they are:

- ``adapter_config.json``: peft's ``LoraConfig``, ``target_modules`` the full path of every
  adapted layer (sorted; peft itself would shorten a long list to suffixes that fit only a
  model of the same depth);
- ``adapter_model.safetensors``: the adapter weights in peft's format (keys
  ``base_model.model.<layer>.lora_{A,B}.weight``), what ``PeftModel.from_pretrained(transformer,
  folder)`` reads;
- ``pytorch_lora_weights.safetensors``: the same weights in diffusers' format (keys
  ``transformer.<layer>...``, the config in its header so that the scale ``lora_alpha / r``
  survives), written by the pipeline class's own ``save_lora_weights``: what
  ``pipe.load_lora_weights(folder)`` reads.

The adapter is small (no base weights) and loads onto a fresh copy of the same checkpoint,
here too (:func:`load_lora`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from jagg_pipeline.config.run import LoraConfig  # the config type (torch-free); re-exported
from jagg_pipeline.support.modes import apply_umask

ADAPTER_NAME = "default"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
# peft's prefix of a PeftModel's keys: the wrapped model is its base_model.model.
PEFT_PREFIX = "base_model.model."

__all__ = ["LoraConfig", "add_lora", "has_lora", "load_lora", "save_lora", "target_modules"]


def target_modules(
    module: nn.Module, suffixes: Sequence[str], exclude: Iterable[str] = ()
) -> list[str]:
    """Full names of the ``nn.Linear`` layers whose name ends with a suffix, minus ``exclude``.

    ``exclude`` holds module-name prefixes (layers that get no gradient, see
    :meth:`Backbone.dead_modules`): an adapter there would never train.
    """
    excluded = tuple(exclude)
    names = [
        name
        for name, layer in module.named_modules()
        if isinstance(layer, nn.Linear)
        and any(name == s or name.endswith("." + s) for s in suffixes)
        and not any(name == e or name.startswith(e + ".") for e in excluded)
    ]
    if not names:
        raise ValueError(
            f"no linear layer of {type(module).__name__} matches the LoRA targets {list(suffixes)}"
        )
    return names


def add_lora(module: nn.Module, settings: LoraConfig, targets: Sequence[str]) -> None:
    """Inject adapters into the layers named ``targets``; freeze every other parameter."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha if settings.alpha is not None else settings.rank,
        lora_dropout=settings.dropout,
        target_modules=list(targets),
        init_lora_weights=True,
    )
    module.requires_grad_(False)
    # The A matrices are drawn at random: from the config's seed, not the global generator's
    # state (which depends on whatever ran before), so equal configs train equal adapters.
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(settings.seed)
        inject_adapter_in_model(config, module, adapter_name=ADAPTER_NAME)
    # peft rewrites a list of 20 or more targets into its shortest suffixes ("proj", "net.2"),
    # which match only a model of this depth; the saved config names the layers themselves.
    module.peft_config[ADAPTER_NAME].target_modules = set(targets)
    for name, param in module.named_parameters():
        param.requires_grad_("lora_" in name)


def has_lora(module: nn.Module) -> bool:
    """Whether peft adapters have been injected into ``module``."""
    return ADAPTER_NAME in getattr(module, "peft_config", {})


def lora_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights alone (peft key names, adapter name removed)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(module, adapter_name=ADAPTER_NAME)


def save_adapter_config(module: nn.Module, directory: str | Path) -> Path:
    """Write ``adapter_config.json`` reproducibly (the same bytes in every process).

    peft keeps target_modules as a set, whose order changes with each interpreter's hash
    seed, so the file is rewritten with the list sorted.
    """
    module.peft_config[ADAPTER_NAME].save_pretrained(str(directory))
    path = Path(directory) / CONFIG_FILE
    data = json.loads(path.read_text())
    if isinstance(data.get("target_modules"), list):
        data["target_modules"] = sorted(data["target_modules"])
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def save_lora(module: nn.Module, directory: str | Path, pipeline: str | None = None) -> Path:
    """Write the adapter config and weights (not the base model) into ``directory``.

    ``pipeline``: the diffusers pipeline class of the checkpoint (``FluxPipeline``, ...),
    whose ``save_lora_weights`` writes the diffusers-format file (None: no such file).
    """
    from safetensors.torch import save_file

    if not has_lora(module):
        raise ValueError("this backbone has no LoRA adapters to save (training mode is not 'lora')")
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    config = save_adapter_config(module, target)
    weights = {k: v.detach().contiguous().cpu() for k, v in lora_state_dict(module).items()}
    save_file({PEFT_PREFIX + k: v for k, v in weights.items()}, str(target / WEIGHTS_FILE))
    if pipeline is not None:
        import diffusers

        getattr(diffusers, pipeline).save_lora_weights(
            str(target),
            transformer_lora_layers=weights,
            transformer_lora_adapter_metadata=json.loads(config.read_text()),
            weight_name=DIFFUSERS_FILE,
        )
    # save_file makes its files private (0600): an adapter is for colleagues to load too.
    for written in (WEIGHTS_FILE, DIFFUSERS_FILE) if pipeline is not None else (WEIGHTS_FILE,):
        apply_umask(target / written)
    return target


def load_lora(module: nn.Module, directory: str | Path) -> None:
    """Load the adapters saved in ``directory`` into ``module``.

    Injects them if ``module`` has none; if it already has adapters (a fresh ``lora``
    backbone), they must have the same rank, scale and layers, and their weights are replaced.
    Raises if the files are missing or if any saved or expected adapter weight is left over.
    """
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    source = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (source / name).is_file():
            raise FileNotFoundError(
                f"{source / name} not found: not a saved LoRA adapter directory"
            )
    config = LoraConfig.from_pretrained(str(source))
    if has_lora(module):
        current = module.peft_config[ADAPTER_NAME]
        if _layout(current) != _layout(config):
            raise ValueError(
                f"the LoRA adapters in {source} (rank {config.r}, alpha {config.lora_alpha}) do "
                f"not match the ones on this backbone (rank {current.r}, alpha "
                f"{current.lora_alpha}) or target other layers"
            )
    else:
        module.requires_grad_(False)
        inject_adapter_in_model(config, module, adapter_name=ADAPTER_NAME)
    # Keys with peft's prefix (written since the export loads in PeftModel) or without it.
    weights = {
        k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(source / WEIGHTS_FILE)).items()
    }
    result = set_peft_model_state_dict(module, weights, adapter_name=ADAPTER_NAME)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"LoRA weights in {source} do not fit this transformer: missing {missing[:5]}, "
            f"unexpected {list(result.unexpected_keys)[:5]}"
        )
    for name, param in module.named_parameters():
        param.requires_grad_("lora_" in name)


def _layout(config) -> tuple:
    """What must agree for saved adapter weights to fit injected adapters.

    The layers are checked by the weights' names: a config written by peft may name them by
    suffixes.
    """
    return (config.r, config.lora_alpha)
