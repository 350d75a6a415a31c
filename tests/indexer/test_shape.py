"""`IndexerShape`: one value for the indexer's workload, validated once; one name and unit for the budget."""

from __future__ import annotations

import argparse

import pytest

from telemetry.errors import ConfigError
from telemetry.model.indexer.shape import (
    MIB,
    REFERENCE_SHAPE,
    IndexerShape,
    ShapeError,
    add_shape_arguments,
    budget_bytes_from_mib,
    budget_mib_text,
    shape_arguments,
    shape_from_args,
)


def test_the_reference_workload():
    assert (REFERENCE_SHAPE.layers, REFERENCE_SHAPE.chunk, REFERENCE_SHAPE.compress_ratio,
            REFERENCE_SHAPE.max_model_len, REFERENCE_SHAPE.logits_budget_bytes) == (45, 8192, 4, 204_800, 512 * MIB)
    assert REFERENCE_SHAPE.padded_width == 51_200 and REFERENCE_SHAPE.budget_elems == 128 * MIB
    assert IndexerShape(fixed_width=1000).padded_width == 1000


@pytest.mark.parametrize("changes, words", [
    ({"layers": 0}, "layers must be a positive integer, got 0"),
    ({"chunk": True}, "chunk must be a positive integer, got True"),
    ({"compress_ratio": 2.0}, "compress_ratio must be a positive integer, got 2.0"),
    ({"logits_budget_bytes": 3}, "logits_budget_bytes must be an integer >= 4 (one float32), got 3"),
    ({"logits_budget_bytes": 96.5 * MIB}, "logits_budget_bytes must be an integer"),
    ({"fixed_width": -3}, "fixed_width must be a positive integer or None"),
    ({"topk": -1}, "topk must be an integer >= 0"),
])
def test_a_bad_shape_names_the_field_and_what_is_expected(changes, words):
    with pytest.raises(ShapeError, match=words.replace("(", r"\(").replace(")", r"\)")) as caught:
        IndexerShape(**changes)
    assert isinstance(caught.value, ConfigError)  # the CLI prints it as one line and exits 2


@pytest.mark.parametrize("mib, expected", [
    (512, 512 * MIB), (96.5, 96 * MIB + MIB // 2), (0.5, MIB // 2),
    (1e-5, 10),  # 10.48576 bytes: rounded down to whole bytes
    (0.1234567, 129_453),  # floor(129453.07...)
])
def test_the_budget_in_mib_is_converted_once_rounding_down_to_whole_bytes(mib, expected):
    assert budget_bytes_from_mib(mib) == expected


@pytest.mark.parametrize("mib", [0, -1, 1e-7, float("nan"), float("inf")])
def test_a_budget_that_holds_no_float32_is_refused(mib):
    with pytest.raises(ShapeError, match="logits budget"):
        budget_bytes_from_mib(mib)


@pytest.mark.parametrize("nbytes", [512 * MIB, 96 * MIB + MIB // 2, MIB // 2, 129_453, 4, 10])
def test_a_budget_written_on_a_command_line_reads_back_to_the_same_bytes(nbytes):
    assert budget_bytes_from_mib(float(budget_mib_text(nbytes))) == nbytes
    assert budget_mib_text(512 * MIB) == "512"


def _parser(**extras: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_shape_arguments(parser, **extras)
    return parser


def test_argparse_defaults_are_the_reference_shape():
    assert shape_from_args(_parser(fixed_width=True, topk=True).parse_args([])) == REFERENCE_SHAPE


@pytest.mark.parametrize("budget", ["96.5", "0.5", "0.1234567", "700"])
def test_a_shape_passed_on_to_another_command_arrives_unchanged(budget):
    shape = shape_from_args(_parser().parse_args(["--budget-mb", budget, "--layers", "3", "--chunk", "4096"]))
    assert shape_from_args(_parser().parse_args(shape_arguments(shape))) == shape


@pytest.mark.parametrize("argv, words", [
    (["--budget-mb", "0"], "must hold at least one float32"),
    (["--budget-mb", "lots"], "expected a number of MiB such as 512 or 96.5, got 'lots'"),
    (["--layers", "0"], "expected a positive integer, got 0"),
])
def test_bad_shape_flags_are_argparse_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(argv)
    assert exited.value.code == 2 and words in capsys.readouterr().err
