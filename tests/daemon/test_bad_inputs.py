"""Issue 16, cases 4, 8, 9 and 11 on the daemon's command line: every bad input is one line and exit 2.

Before: NaN and Inf burst windows passed `--check-config` and crashed at start; non-UTF-8 and
giant-integer config files, `--listen "[::1:38101"` and `--proc-root /nonexistent` were accepted or
ended in a traceback; a backtracking kernel-log pattern froze `/metrics` and SIGTERM alike.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.daemon.helpers import ROOT, Daemon, check_config, wait_for


def _config_files(tmp_path: Path) -> dict[str, bytes]:
    return {
        "nan_window.yaml": b"kmsg:\n  burst_window_seconds: .nan\n",
        "inf_window.yaml": b"kmsg:\n  burst_window_seconds: .inf\n",
        "negative_window.yaml": b"kmsg:\n  burst_window_seconds: -1\n",
        "huge_window.yaml": b"kmsg:\n  burst_window_seconds: 1.0e300\n",
        "giant_integer.yaml": b"kmsg:\n  max_xid_codes: " + b"9" * 5000 + b"\n",
        "big_integer.yaml": b"nvml:\n  max_processes: 123456789012345678901234567890\n",
        "bool_as_number.yaml": b"kmsg:\n  max_xid_codes: true\n",
        "not_utf8.yaml": b"listen: \"\xff\xfe:9101\"\n",
        "alias_bomb.yaml": b"a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                           b"kmsg:\n  patterns: [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n",
        "deep.yaml": b"[" * 5000 + b"]" * 5000 + b"\n",
        "too_big.yaml": b"# " + b"x" * (2 << 20) + b"\n",
        "listen_int.yaml": b"listen: 9101\n",
        "listen_v6_unclosed.yaml": b"listen: \"[::1:38101\"\n",
        "unknown_key.yaml": b"kmsg:\n  burst_windw_seconds: 3\n",
        "many_patterns.yaml": b"kmsg:\n  patterns:\n" + b"".join(
            f"    - {{name: p{i}, regex: x{i}}}\n".encode() for i in range(65)),
        "backreference.yaml": b"kmsg:\n  patterns:\n    - {name: twice, regex: '(a)\\1'}\n",
        "lookahead_role.yaml": b"processes:\n  roles:\n    - {role: w, cmdline: '(?=vllm)'}\n",
        "long_name.yaml": b"kmsg:\n  patterns:\n    - {name: " + b"n" * 100 + b", regex: x}\n",
        "ignore_not_bool.yaml": b"kmsg:\n  ignore_test_lines: \"no\"\n",
        "path_not_string.yaml": b"state_dir: [1, 2]\n",
        "top_is_list.yaml": b"- a\n- b\n",
        "web_config_missing.yaml": f"web_config: {tmp_path / 'missing-web.yml'}\n".encode(),
        "empty_kmsg_path.yaml": b"kmsg:\n  path: ''\n",
        "zero_processes.yaml": b"nvml:\n  max_processes: 0\n",
        "inf_recheck.yaml": b"processes:\n  recheck_seconds: .inf\n",
        "no_roles.yaml": b"processes:\n  roles: []\n",
        "tab_indent.yaml": b"kmsg:\n\tpath: /dev/kmsg\n",
    }


def _cases(tmp_path: Path) -> list[tuple[str, ...]]:
    files = []
    for name, content in _config_files(tmp_path).items():
        path = tmp_path / name
        path.write_bytes(content)
        files.append(("--config", str(path)))
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    return [
        *files,
        ("--config", str(fifo)),  # must not block on a FIFO
        ("--config", str(tmp_path)),  # a directory
        ("--config", str(tmp_path / "missing.yaml")),
        ("--burst-window", "nan"), ("--burst-window", "inf"), ("--burst-window", "-inf"), ("--burst-window", "1e400"),
        ("--burst-window", "-1"), ("--burst-window", "soon"), ("--burst-window", "99999"),
        ("--listen", "[::1:38101"), ("--listen", "::1:38101"), ("--listen", "[::1]38101"), ("--listen", "[::1]:"),
        ("--listen", "[nothex::1]:9101"), ("--listen", "127.0.0.1:65536"), ("--listen", "127.0.0.1:-1"),
        ("--listen", "127.0.0.1:٣٣"), ("--listen", "127.0.0.1:9101 "), ("--listen", "localhost"),
        ("--listen", "bad_host!:9101"), ("--listen", ""), ("--listen", "127.0.0.1:99999999999999999999"),
        ("--listen", "a" * 300 + ":9101"), ("--listen", "192.0.2.1:9101"), ("--listen", "no-such-host.invalid:9101"),
        ("--proc-root", "/nonexistent"), ("--proc-root", str(tmp_path)), ("--proc-root", ""),
        ("--kmsg-pattern", "noequals"), ("--kmsg-pattern", "x=("), ("--kmsg-pattern", "1x=a"),
        ("--kmsg-pattern", "x="), ("--kmsg-pattern", r"x=(a)\1"), ("--kmsg-pattern", "x=(?<=a)b"),
        ("--kmsg-pattern", "x=" + "a" * 2000), ("--kmsg-pattern", "x=((a{100}){100}){100}"),
        ("--kmsg-pattern", "a=x", "--kmsg-pattern", "a=y"),
        ("--disable-collector", "gpu"), ("--log-level", "loud"), ("--no-such-flag",), ("--listen",),
        ("--disable-collector",), ("--burst-window", ""), ("--listen", "0.0.0.0:9101:1"),
        ("--state-dir", ""),
        ("--kmsg", ""), ("--web-config", str(tmp_path / "missing-web.yml")),
    ]


def _run(args: tuple[str, ...], state_dir: Path) -> tuple[tuple[str, ...], subprocess.CompletedProcess | str]:
    argv = [sys.executable, "-m", "telemetry", "daemon", *args]
    if "--state-dir" not in args:
        argv += ["--state-dir", str(state_dir)]
    if "--listen" not in args:
        argv += ["--listen", "127.0.0.1:0"]  # should a case start after all, it takes no real port
    try:
        return args, subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return args, "still running after 30 s: the bad input was accepted"


@pytest.mark.slow
def test_every_bad_input_is_one_line_and_exit_2_never_a_traceback(tmp_path):
    """Every case starts the real daemon (a subprocess: were one accepted, it would start, and time out
    here); the config-file and burst-window cases also with --check-config, in this process (`check_config`),
    except the FIFO (a blocked open can be timed out only in a subprocess)."""
    cases = _cases(tmp_path)
    state = tmp_path / "state-never-created"
    checked = [args for args in cases if args[0] in ("--config", "--burst-window")]
    fifo = [args for args in checked if args[-1].endswith(".fifo")]
    runs = cases + [(*args, "--check-config") for args in fifo]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda a: _run(a, state), runs))
    results += [((*args, "--check-config"), check_config(*args, "--state-dir", str(state)))
                for args in checked if args not in fifo]
    bad: list[tuple] = []
    for args, result in results:
        if isinstance(result, str):
            bad.append((args[:3], result))
            continue
        lines = result.stderr.strip().splitlines()
        if result.returncode != 2 or len(lines) != 1 or "Traceback" in result.stderr or not lines[0].startswith(
                "memtel daemon: error: "):
            bad.append((args[:3], result.returncode, result.stderr[-300:]))
    print(f"{len(results)} bad inputs tried ({len(cases)} distinct), {len(results) - len(bad)} answered with one "
          "line and exit 2")
    assert bad == []
    assert not state.exists()  # nothing half-started
    assert len(cases) >= 70


def test_nan_burst_window_is_refused_by_check_config_too(tmp_path):
    config = tmp_path / "nan.yaml"
    config.write_text("kmsg:\n  burst_window_seconds: .nan\n")
    result = subprocess.run([sys.executable, "-m", "telemetry", "daemon", "--config", str(config), "--check-config"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "kmsg.burst_window_seconds: expected a finite number from 0 to 3600, got nan" in result.stderr


def test_backtracking_pattern_and_a_34_character_line_no_longer_freeze_metrics_or_sigterm(tmp_path):
    log = tmp_path / "kern.log"
    line = "a" * 33 + "!"  # 34 characters: minutes of backtracking for ^(a+)+$ in Python's re
    log.write_text(f"6,1,1000,-;{line}\n")
    with Daemon(tmp_path / "state", "--kmsg", str(log), "--kmsg-pattern", "evil=^(a+)+$",
                "--kmsg-pattern", "hit=a!$", "--disable-collector", "nvml") as daemon:
        scrape = wait_for(lambda: (s := daemon.scrape()).value("memtel_kernel_kmsg_records_total") == 1 and s,
                          timeout=5, what="the line classified")
        assert scrape.value("memtel_kernel_pattern_matches_total", pattern="evil") == 0
        assert scrape.value("memtel_kernel_pattern_matches_total", pattern="hit") == 1
        started = time.monotonic()
        assert httpx.get(daemon.url + "/metrics", timeout=2).status_code == 200
        assert time.monotonic() - started < 1
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(5) == 0


def test_backtracking_role_pattern_against_a_hostile_command_line_does_not_freeze_a_scrape(tmp_path):
    # Any local user chooses their command line; a role pattern runs on the scrape's thread.
    config = tmp_path / "roles.yaml"
    config.write_text("processes:\n  roles:\n    - {role: evil, cmdline: '^(a+)+$'}\n")
    hostile = subprocess.Popen(["bash", "-c", f"exec -a {'a' * 33}! sleep 60"])
    try:
        with Daemon(tmp_path / "state", "--config", str(config), "--kmsg", "/dev/null",
                    "--disable-collector", "nvml") as daemon:
            for _ in range(3):
                started = time.monotonic()
                scrape = daemon.scrape()
                assert time.monotonic() - started < 2
                assert scrape.value("memtel_collector_success", collector="processes") == 1
    finally:
        hostile.kill()
        hostile.wait()


def test_proc_root_that_is_not_a_proc_is_refused_before_anything_starts(tmp_path):
    result = subprocess.run([sys.executable, "-m", "telemetry", "daemon", "--proc-root", "/nonexistent",
                             "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s")],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--proc-root /nonexistent does not exist" in result.stderr
    assert not (tmp_path / "s").exists()
