"""The engines' options are declared once (core/options.py): every copy reads that one."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from jagg_pipeline.bench.gradcheck_config import GradcheckConfig
from jagg_pipeline.config.run import JaggConfig
from jagg_pipeline.core import jagg
from jagg_pipeline.core.options import (
    DEFAULT_OPTIONS,
    EngineOptions,
    option_choices,
    option_field,
    option_help,
)

OPTIONS = list(EngineOptions.names())
# The engines: each takes the options as ONE record.
ENGINES = [
    jagg.window_gradient,
    jagg.unit_gradient,
    jagg.accumulate_gradient,
    jagg.trajectory_gradient,
    jagg.probe_windows,
]
# The layout helpers: each takes the one or two options it reads, by name.
HELPERS = [
    jagg.split_windows,
    jagg.interpolation_weights,
    jagg.anchor_layout,
    jagg.approximated_units,
    jagg.reusable_steps,
]


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {declared.name: declared for declared in dataclasses.fields(cls)}


@pytest.mark.parametrize("settings", [JaggConfig, GradcheckConfig])
def test_settings_copy_each_option_s_default_help_and_choices(settings):
    declared, copied = _fields(EngineOptions), _fields(settings)
    hints = typing.get_type_hints(settings)
    for name in OPTIONS:
        if name not in copied:
            continue
        assert copied[name].default == declared[name].default, name
        assert copied[name].metadata["help"] == option_help(name), name
        if option_choices(name):
            assert typing.get_args(hints[name]) == option_choices(name), name
    assert set(OPTIONS) <= set(_fields(JaggConfig)), "the run config sets every option"


def test_engines_take_the_declared_options_as_one_record():
    for engine in ENGINES:
        parameters = inspect.signature(engine).parameters
        assert parameters["options"].default is DEFAULT_OPTIONS, engine
        assert not set(OPTIONS) & set(parameters), engine


def test_helper_defaults_are_the_declared_ones():
    checked = 0
    for helper in HELPERS:
        for name, parameter in inspect.signature(helper).parameters.items():
            if name in OPTIONS:
                assert parameter.default == getattr(DEFAULT_OPTIONS, name), (helper, name)
                checked += 1
    assert checked >= 6


def test_run_config_hands_the_engines_its_options():
    config = JaggConfig(anchors="shared", endpoint_backward="joint")
    assert config.engine_options() == EngineOptions(anchors="shared", endpoint_backward="joint")


def test_gradcheck_flags_are_built_from_the_declaration():
    import argparse

    from jagg_pipeline.cli import gradcheck

    parser = argparse.ArgumentParser()
    gradcheck.register(parser.add_subparsers())
    actions = {
        action.dest: action
        for sub in parser._subparsers._group_actions
        for action in sub.choices["gradcheck"]._actions
    }
    for name in ("weights", "no_interp", "endpoint_backward"):
        assert tuple(actions[name].choices) == option_choices(name)
        assert actions[name].help == option_help(name)
        assert actions[name].default == getattr(DEFAULT_OPTIONS, name)


def test_an_unknown_option_is_refused_by_name():
    with pytest.raises(KeyError, match="window_size"):
        option_field("window_size")
