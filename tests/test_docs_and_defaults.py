"""Issue 19, item 11: docs and defaults a new user stumbled on.

Before: README and docs/hook.md listed the core dependencies without google-re2; `memtel run` had no `--addr`
and its announcement did not say the exporter listens on every interface; `whatif` replayed a
garbage_collection_threshold without a memory fraction without a word; error lines came in two forms
(`memtel whatif: <path>: ...` against `memtel ab: error: ...`); `memtel forecast` spelled the width `--mode`
where `memtel replay` says `--arm`. (`memtel run`'s leftover run folder: tests/run/test_run_folder.py.)
Bad inputs run in-process through telemetry.cli.main.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import tomllib

from telemetry.cli import main
from telemetry.run.cli import configure, prepare

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "tests" / "fixtures" / "allocator-snapshots" / "h200-torch2.11"
ERROR_LINE = re.compile(r"^memtel [a-z]+( [a-z-]+)?: error: \S")  # a sub-subcommand's names it (lab serve)


def _core_dependencies() -> list[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0] for spec in data["project"]["dependencies"]]


def test_the_core_dependencies_are_listed_without_google_re2():
    names = _core_dependencies()
    assert "google-re2" in names
    readme = (ROOT / "README.md").read_text()
    (readme_list,) = re.findall(r"the core only \(([^)]*)\)", readme)
    (hook_list,) = re.findall(r"pip install\s+/path/to/memtel`: ([^;]*) only;", (ROOT / "docs" / "hook.md").read_text())
    for listed in (readme_list, hook_list):
        assert {n.lower() for n in re.split(r",\s*|\s+and\s+", listed.replace("\n", " "))} == \
            {n.lower() for n in names}, listed


def test_memtel_run_has_no_addr_flag(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--targets", "json:dumps", "--addr", "127.0.0.1", "--", "true"])
    env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(tmp_path)}
    tmp_path.chmod(0o700)
    _, prepared = prepare(args, env, 4242)
    assert prepared["MEMTEL_ADDR"] == "127.0.0.1"
    assert main(["run", "--targets", "json:dumps", "--addr", "192.0.2.1", "--", "true"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert ERROR_LINE.match(line) and "--addr '192.0.2.1': cannot listen there" in line, line
    # The announcement says when the exporter listens on every interface, and how to restrict it.
    from telemetry.hook.session import exporter_where

    assert "every interface" in exporter_where("http", "0.0.0.0", 9200) and "--addr" in exporter_where(
        "http", "0.0.0.0", 9200)
    assert exporter_where("http", "127.0.0.1", 9200) == "http://127.0.0.1:9200/metrics"


def test_whatif_says_nothing_of_a_gc_threshold_without_a_memory_fraction(capsys):
    trace = str(SNAPSHOTS / "whatif-ring.pickle.gz")
    assert main(["whatif", trace, "--config", "garbage_collection_threshold:0.6", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["trace"]["notes"]
    assert any("garbage_collection_threshold does nothing without a memory fraction" in n for n in notes), notes
    assert main(["whatif", trace, "--config", "garbage_collection_threshold:0.6,per_process_memory_fraction:0.5",
                 "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["trace"]["notes"]
    assert not any("does nothing without a memory fraction" in n for n in notes), notes


@pytest.mark.parametrize("argv", [
    ["whatif", "{missing}"],
    ["forecast", "--snapshot", "{missing}", "--tokens", "1000"],
    ["allocsim", "{missing}"],
    ["flight"],
    ["flight", "show", "--file", "{missing}"],
    ["ab", "report", "{missing}"],
    ["run", "--targets", "json:dumps"],
])
def test_error_prefixes_differ_between_commands(tmp_path, capsys, argv):
    code = main([a.replace("{missing}", str(tmp_path / "missing.file")) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    ran = " ".join(argv[:2]) if argv[0] in ("flight", "ab") and len(argv) > 1 else argv[0]
    assert ERROR_LINE.match(err) and err.startswith(f"memtel {ran}: error: "), err


def test_forecast_spells_the_width_mode_mode_where_replay_says_arm(capsys):
    snapshot = str(SNAPSHOTS / "seeded-default-stock-state24k.snapshot.pickle.gz")
    base = ["forecast", "--snapshot", snapshot, "--tokens", "8192", "--json"]
    outputs = {}
    for flag in ("--arm", "--mode"):
        assert main([*base, flag, "fixed"]) == 0
        outputs[flag] = json.loads(capsys.readouterr().out)
    assert outputs["--arm"] == outputs["--mode"]
    assert main([*base, "--arm", "stock"]) == 0
    assert json.loads(capsys.readouterr().out) != outputs["--arm"]  # the flag is really read
    with pytest.raises(SystemExit):
        main(["forecast", "--help"])
    shown = capsys.readouterr().out
    assert "--arm" in shown and "--mode" not in shown  # one spelling shown; the other a hidden alias
