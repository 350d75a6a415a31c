import argparse
from pathlib import Path

import pytest

from telemetry.daemon import cli as daemon_cli
from telemetry.daemon.config import ConfigError, enabled_collectors, from_args, from_mapping, load_file

EXAMPLE = Path(__file__).parents[2] / "configs" / "examples" / "daemon.yaml"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    daemon_cli.configure(parser)
    return parser.parse_args(argv)


def test_defaults():
    config = from_args(parse())
    assert (config.listen_host, config.listen_port) == ("0.0.0.0", 9101)
    assert config.kmsg.path == "/dev/kmsg" and config.kmsg.burst_window_seconds == 2.0
    assert enabled_collectors(config) == ("meminfo", "vmstat", "pressure", "buddyinfo", "headroom", "nvml", "processes",
                                         "kmsg")
    assert {r.role for r in config.processes.roles} == {"api_server", "engine_core", "worker"}


def test_example_config_loads_and_flags_win(tmp_path):
    config = load_file(EXAMPLE)
    assert config.kmsg.patterns and all(p.regex.search is not None for p in config.kmsg.patterns)
    args = parse("--config", str(EXAMPLE), "--listen", "127.0.0.1:9999", "--kmsg", "/tmp/x",
                 "--kmsg-pattern", "mine=hello", "--disable-collector", "nvml", "--state-dir", str(tmp_path))
    merged = from_args(args)
    assert (merged.listen_host, merged.listen_port) == ("127.0.0.1", 9999)
    assert merged.kmsg.path == "/tmp/x" and merged.state_dir == tmp_path
    assert [p.name for p in merged.kmsg.patterns][-1] == "mine"
    assert len(merged.kmsg.patterns) == len(config.kmsg.patterns) + 1
    assert "nvml" not in enabled_collectors(merged)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"lisen": "0.0.0.0:1"}, "unknown key(s) lisen; valid keys: listen"),
        ({"kmsg": {"pattern": []}}, "kmsg: unknown key(s) pattern; valid keys: path, burst_window_seconds"),
        ({"kmsg": {"patterns": [{"name": "bad", "regex": "([unclosed"}]}},
         "kmsg.patterns[0].regex (bad): bad regular expression '([unclosed'"),
        ({"kmsg": {"patterns": [{"name": "1x", "regex": "a"}]}}, "kmsg.patterns[0].name: '1x' is not a name"),
        ({"kmsg": {"patterns": [{"name": "a", "regex": "a"}, {"name": "a", "regex": "b"}]}}, "defined twice"),
        ({"kmsg": {"burst_window_seconds": "soon"}}, "kmsg.burst_window_seconds: expected a number from 0 to 3600"),
        ({"listen": "9101"}, "listen: '9101' is not HOST:PORT"),
        ({"collectors": {"disabled": ["gpu"]}}, "unknown collector 'gpu'; valid: meminfo, vmstat"),
        ({"processes": {"roles": [{"role": "x"}]}}, "processes.roles[0]: needs both 'role' and 'cmdline'"),
        ({"log_level": "loud"}, "log_level: 'loud'; valid: debug"),
        (["not", "a", "mapping"], "top level: expected a mapping"),
    ],
)
def test_bad_config_names_what_is_wrong(data, expected):
    with pytest.raises(ConfigError) as info:
        from_mapping(data, "my.yaml")
    assert str(info.value).startswith("my.yaml: ") and expected in str(info.value)


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kmsg: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_file(bad)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_file(tmp_path / "missing.yaml")


def test_bad_flag_pattern():
    with pytest.raises(ConfigError, match=r"--kmsg-pattern 'x=\(': bad regular expression"):
        from_args(parse("--kmsg-pattern", "x=("))
    with pytest.raises(ConfigError, match="expected NAME=REGEX"):
        from_args(parse("--kmsg-pattern", "noequals"))
