"""telemetry/scrape/reader.py: an exposition read back by catalogue entry, and readers that follow a rename."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from telemetry.catalogue import metrics as catalogue
from telemetry.scrape import ExpositionError, parse, parse_body, series_name


def _exposition_of(*families: Metric) -> str:
    class Fixed:
        def collect(self) -> list[Metric]:
            return list(families)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    return generate_latest(registry).decode()


def _hook_text() -> str:
    calls = catalogue.HOOK_CALLS.new()
    calls.add_metric(["indexer", "0", "n1"], 5)
    calls.add_metric(["mlp", "0", "n1"], 7)
    budget = catalogue.FORECAST_FIT_BUDGET.new()
    budget.add_metric(["0", "n1"], 8e9)
    delta = catalogue.HOOK_RESERVED_DELTA.new()
    delta.add_metric(["indexer", "0", "n1"], [("1.0", 1), ("+Inf", 3)], 42.0)
    return _exposition_of(calls, budget, delta)


def test_series_are_found_by_their_entry() -> None:
    exposition = parse(_hook_text())
    assert exposition.total(catalogue.HOOK_CALLS) == 12   # a counter: its _total series
    assert exposition.first(catalogue.HOOK_CALLS, site="mlp") == 7
    assert exposition.first(catalogue.FORECAST_FIT_BUDGET, rank="0") == 8e9
    assert exposition.first(catalogue.HOOK_RESERVED_DELTA, "_sum") == 42.0
    assert exposition.first(catalogue.HOOK_RESERVED_DELTA, "_count") == 3
    assert exposition.labelled("node") == "n1"


def test_absent_is_none_never_zero() -> None:
    exposition = parse(_hook_text())
    assert exposition.first(catalogue.MEM_AVAILABLE) is None and exposition.total(catalogue.MEM_AVAILABLE) is None
    assert exposition.of(catalogue.HOOK_CALLS, site="nope") == []


def test_a_histogram_is_read_by_its_part() -> None:
    with pytest.raises(ValueError, match="name its part"):
        parse(_hook_text()).first(catalogue.HOOK_RESERVED_DELTA)
    with pytest.raises(ValueError, match="no _sum part"):
        series_name(catalogue.HOOK_CALLS, "_sum")


def test_only_parses_the_entries_asked_for() -> None:
    exposition = parse(_hook_text(), only=[catalogue.FORECAST_FIT_BUDGET])
    assert {s.name for s in exposition.samples} == {catalogue.FORECAST_FIT_BUDGET.series}


@pytest.mark.parametrize(("body", "says"), [
    (b"\xff\xfe", "not UTF-8"),
    (b"memtel_x 1\nmemtel_y 2", "cut short"),
    (b"<html>hello</html>\n", "not the metrics text format"),
])
def test_what_is_not_an_exposition_is_one_line(body: bytes, says: str) -> None:
    with pytest.raises(ExpositionError) as caught:
        parse_body(body)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_renamed_entry_is_read_under_its_new_name_by_the_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proof that readers type no name: rename an entry, produce the family from it, and the ledger's node view
    reads the value under the new name (and no longer under the old)."""
    from telemetry.ledger.scrape import Scrape, node_view

    original = catalogue.MEM_AVAILABLE
    renamed = dataclasses.replace(original, name="memtel_node_renamed_available_bytes")
    monkeypatch.setattr(catalogue, "MEM_AVAILABLE", renamed)
    view = node_view("n1", Scrape("http://n1:9101/metrics", parse(_exposition_of(renamed.new(123.0)))))
    assert view.mem_available == 123
    old_name = parse(_exposition_of(original.new(5.0)))
    assert node_view("n1", Scrape("http://n1:9101/metrics", old_name)).mem_available is None
