"""The flight recorder's hook scraper (telemetry/flight/hooks.py): a hook target may carry credentials
(`http://user:password@host:port`), and the password is never printed: not by --check-config, not in a
refusal, not in the scraper's log, not in the recorded series, not in protect's start line."""

from __future__ import annotations

import logging

from telemetry.daemon.config import from_mapping
from telemetry.flight.hooks import HookScraper, hook_series
from tests.daemon.helpers import check_config
from tests.support.ports import free_port

PASSWORD = "hunter2-7f3a"


def test_a_hook_target_with_credentials_is_checked_by_the_url_parser_and_its_password_never_printed(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(f"flight:\n  hook_targets: ['http://admin:{PASSWORD}@127.0.0.1:9200']\n")
    bad.write_text(f"flight:\n  hook_targets: ['http://admin:{PASSWORD}@127.0.0.1:9200', "
                   f"'admin:{PASSWORD}@127.0.0.1:9201']\n")
    accepted = check_config("--config", str(good))
    assert accepted.returncode == 0 and "configuration OK" in accepted.stdout
    refused = check_config("--config", str(bad))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "flight.hook_targets[1]: '***@127.0.0.1:9201'" in refused.stderr
    assert PASSWORD not in accepted.stdout + accepted.stderr + refused.stdout + refused.stderr


def test_the_scrapers_log_and_records_write_the_credentials_as_stars(caplog):
    target = f"http://admin:{PASSWORD}@127.0.0.1:{free_port()}"  # nothing listens there
    scraper = HookScraper((target,), timeout_seconds=0.5)
    with caplog.at_level(logging.INFO, logger="memtel.daemon.flight"):
        scraper.scrape_once()
    assert scraper.latest() == {}
    assert "hook exporter http://***@127.0.0.1:" in caplog.text and PASSWORD not in caplog.text
    series = hook_series("# TYPE memtel_allocator_reserved_bytes gauge\n"
                         'memtel_allocator_reserved_bytes{rank="0"} 7.0\n', target)
    assert list(series.values()) == [7.0]
    assert "http://***@127.0.0.1:" in next(iter(series)) and PASSWORD not in next(iter(series))


def test_protects_start_line_names_the_hook_targets_without_their_password(caplog):
    from telemetry.daemon.cli import build_protect

    config = from_mapping({"flight": {"hook_targets": [f"http://admin:{PASSWORD}@127.0.0.1:9200"]},
                           "protect": {"enabled": True, "command": ["/bin/true"]}})
    with caplog.at_level(logging.INFO):
        build_protect(config)
    assert "engine starts read from http://***@127.0.0.1:9200" in caplog.text and PASSWORD not in caplog.text
