"""An API call's error names what to pass as the call takes it: each command-line option and
config key the function takes as its keyword (a flag as ``=True``), a held object as the keyword
it came by; an option it does not take, and a key a config file set, stay as they are."""

from __future__ import annotations

from pathlib import Path

import pytest
from project import load_net

import gradscope
from gradscope.api.configured import api_words, keywords
from gradscope.errors import ConfigError, DataError, ModelError
from gradscope.validation import Options


@pytest.mark.parametrize(
    ("fn", "options", "text", "said"),
    [
        (gradscope.validate, Options, "--removal-refs and --removal", "removal_refs= and removal="),
        (
            gradscope.validate,
            Options,
            "with --resume, one --column",
            "with resume=True, one columns=",
        ),
        (gradscope.validate, Options, "no --through-training here", "no --through-training here"),
        (gradscope.norms, None, "--per-layer over --limit rows", "per_layer=True over limit= rows"),
        (gradscope.norms, None, "--ref's file (--ref)", "--ref's file (--ref)"),
        (gradscope.influence, None, "--per-ref, --cg-tolerance", "per_ref=True, cg_tolerance="),
        (gradscope.query, None, "pass --exact", "pass exact=True"),
        (gradscope.per_example_norms, None, "--include, --limit", "include=, --limit"),
        (gradscope.norms, None, "'data.batch_size' must be", "batch_size= must be"),
        (gradscope.norms, None, "a different config.data.path", "a different data="),
        (gradscope.norms, None, "set data.pad.x to pad", "set pad={'x': ...} to pad"),
        (gradscope.norms, None, "model.layers.0.weight, data.pt", "model.layers.0.weight, data.pt"),
        (gradscope.per_example_norms, None, "loss.name, data.limit", "loss=, data.limit"),
    ],
)
def test_options_become_the_functions_keywords(fn, options, text, said) -> None:
    assert api_words(text, keywords(fn, options)) == said


def test_errors_of_each_kind_of_call_name_its_keywords(project: Path) -> None:
    """A batch function (no command behind it) and a command's function alike; the message and
    where it points both."""
    net, x, y = load_net(project)
    net, x = net.double(), x.double()
    with pytest.raises(ConfigError, match=r"^curvature= must be one of .*'bogus' \(curvature=\)$"):
        gradscope.per_example_influence(net, x, y, x[:2], y[:2], curvature="bogus")
    with pytest.raises(ModelError, match=r"^precondition= file not found"):
        gradscope.per_example_influence(net, x, y, x[:2], y[:2], precondition="none.pt")
    with pytest.raises(ConfigError, match=r"^include= pattern 'fc9\*' matches no .*\(include=\)$"):
        gradscope.per_example_norms(net, x, y, include=["fc9*"])
    with pytest.raises(ModelError, match=r"targets hold 9 examples.*\(inputs=, targets=\)$"):
        gradscope.per_example_norms(net, x, y[:-1])
    with pytest.raises(ModelError, match=r"targets hold 3 .*\(ref_inputs=, ref_targets=\)$"):
        gradscope.per_example_influence(net, x, y, x[:2], y[:3])
    with pytest.raises(ConfigError, match=r"^cg_tolerance= must be in \(0, 1\), got 2"):
        gradscope.influence(net, {"x": x, "y": y}, ref={"x": x, "y": y}, curvature="gn",
                            cg_tolerance=2)  # fmt: skip


def test_a_config_key_is_named_by_the_keyword_that_set_it(project: Path) -> None:
    """Errors named the config's keys and held objects by their address (``no column 'z' for
    data.inputs (<dict at 0x7f...>)``), also where no config was given, or the reference's
    rows were at fault. A key the config file set keeps its name there."""
    net, x, y = load_net(project)
    with pytest.raises(ConfigError, match=r"^batch_size= must be at least 1, got 0 \(the API"):
        gradscope.norms(net, {"x": x, "y": y}, batch_size=0)
    with pytest.raises(DataError, match=r"^no column 'z' for inputs= \(columns: x, y\) \(data=\)$"):
        gradscope.norms(net, {"x": x, "y": y}, inputs=["z"])
    with pytest.raises(DataError, match=r"^no column 'x' for inputs= .*\(ref=\)$"):
        gradscope.influence(net, {"x": x, "y": y}, ref={"a": x, "y": y}, curvature="none")
    config = project / "zero.yaml"
    config.write_text(
        (project / "config.yaml").read_text().replace("batch_size: 4", "batch_size: 0")
    )
    with pytest.raises(ConfigError, match=r"^'data.batch_size' must be at least 1"):
        gradscope.norms(config)
