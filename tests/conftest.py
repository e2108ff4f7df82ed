"""Test-wide settings: no hub access, one thread (tiny models on a shared 2-core machine)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def float64():
    """Run a test with float64 as the default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


# The toy world that integration tests share: small enough to build in about three minutes on
# two cores, trained long enough that objects appear (DESIGN section 6: after ~700 steps).
TOY_TEST_STEPS, TOY_TEST_BATCH, TOY_TEST_CLIP_STEPS = 1500, 16, 150


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory):
    """(directory, report) of a toy world built once per test session."""
    from jagg_pipeline.toyworld.build import BuildSettings, build_toyworld
    from jagg_pipeline.toyworld.clip import ClipSettings
    from jagg_pipeline.toyworld.pretrain import PretrainSettings

    out = tmp_path_factory.mktemp("toy-world")
    settings = BuildSettings(
        pretrain=PretrainSettings(steps=TOY_TEST_STEPS, batch=TOY_TEST_BATCH),
        clip=ClipSettings(steps=TOY_TEST_CLIP_STEPS),
        eval_steps=10,
    )
    return out, build_toyworld(out, settings, progress=False)


def toy_experiment(world, **sections):
    """The default experiment pointed at a built toy world; ``sections`` update it."""
    out, _ = world
    data = {
        "backbone": {"path": str(out / "sd3")},
        "rewards": {"toy_clipscore": {"model": str(out / "clip")}},
        "tracking": {"backend": "none"},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data
