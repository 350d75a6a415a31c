"""The daemon's protect action (telemetry/daemon/protect.py) on the shipped corpus, its config as hostile
input, and its actions done for real (a command, a signal through a pidfile)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from telemetry.alerts.timeline import load_timeline
from telemetry.daemon.config import from_mapping
from telemetry.daemon.protect import (
    ActionError,
    Protect,
    ProtectConfig,
    read_pidfile,
    run_action,
    start_remaining_bytes,
)
from telemetry.errors import ConfigError
from telemetry.procfs.headroom import FALLING

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "alerts" / "corpus"
HEADROOM = "memtel_node_unified_headroom_bytes"
MEM_TOTAL = "memtel_node_mem_total_bytes"
WITHOUT_RECLAIM = "memtel_node_unified_headroom_without_reclaim_bytes"
SUCCESS_RATIO = "memtel_node_huge_page_fault_success_ratio"
BENIGN = ("page-cache-churn", "large-flat-allocation", "slow-leak-above-floor", "nv-err-at-rest",
          "model-weights-in-page-cache", "no-nvidia-driver",
          # engine starts the hook announces (issue 29): Spark-sized at 0.7, 0.85, 0.9, a restart loop, two
          # engines together, a start on a node already low
          "spark-start-0.70", "spark-start-0.85", "spark-start-0.90", "spark-restart-loop",
          "two-engines-starting-together", "start-on-a-low-node",
          # issue 38: vLLM at 0.9 on a real Spark whose KV cache comes out of a cold page cache (ratio 0.88)
          "spark-headless-start-0.90-cold-page-cache")


def replay(name: str, dry_run: bool = False, hook: dict[str, float] | None = None,
           discount: bool = True) -> tuple[list, list[str], float]:
    """Feed a corpus timeline through Protect second by second, as the daemon's loop does; (decisions, the
    actions run, the timeline's onset or start). `hook`: series a hook target answers besides the timeline's.
    `discount` False: the starts' remaining bytes taken byte for byte (the reading before issue 38)."""
    timeline = load_timeline(CORPUS / f"{name}.jsonl.gz")
    records = iter(timeline.records)
    current = [timeline.records[0]]
    acted: list[str] = []

    def sample():
        values = {**current[0].values, **(hook or {})}
        reading = (values[HEADROOM], values[MEM_TOTAL], start_remaining_bytes(values, values[MEM_TOTAL]))
        return (*reading, values[WITHOUT_RECLAIM], values.get(SUCCESS_RATIO)) if discount else reading

    def action(config, roles):
        acted.append(config.describe_action())
        return "recorded by the test"

    protect = Protect(ProtectConfig(enabled=True, dry_run=dry_run, command=("/bin/true",)), sample,
                      clock=lambda: current[0].time, action=action)
    decisions = []
    for record in records:
        current[0] = record
        decision = protect.step()
        if decision is not None:
            decisions.append(decision)
    onset = timeline.outcome.onset_at if timeline.outcome.onset_at is not None else timeline.start
    return decisions, acted, onset


def test_protect_acts_once_within_3_s_of_the_replayed_collapse():
    decisions, acted, onset = replay("collapse-29-to-2.5-gib-in-9s")
    assert len(decisions) == 1 and acted == ["run /bin/true"], decisions
    (decision,) = decisions
    assert decision.decision == "acted"
    assert decision.time - onset <= 3.0, f"acted {decision.time - onset:.0f} s after the collapse began"
    assert decision.evidence.drop_bytes >= 4 * 2**30 and decision.evidence.slope_bytes_per_second < -0.5 * 2**30


@pytest.mark.parametrize("name, within_s", [("start-asks-more-than-the-node-has", 3),
                                             ("collapse-during-an-engine-start", 10)])
def test_protect_acts_once_on_a_start_that_asks_too_much_or_a_collapse_during_a_start(name, within_s):
    decisions, acted, onset = replay(name)
    assert len(decisions) == 1 and acted == ["run /bin/true"], decisions
    assert decisions[0].time - onset <= within_s
    assert decisions[0].evidence.after_starts_bytes is not None and decisions[0].evidence.after_starts_bytes < 4 * 2**30


HOSTILE_START = 'memtel_engine_start_remaining_bytes{pid="4242",rank="0",target="127.0.0.1:9200"}'


@pytest.mark.parametrize("claim", [-1e308, -1.0, 0.0, float("nan"), float("-inf")])
def test_a_hook_that_claims_a_start_taking_nothing_or_less_neither_silences_nor_delays_the_action(claim):
    """Issue 41: a process answering on a hook target with a negative memtel_engine_start_remaining_bytes made
    every fall "explained" (protect never acted on the collapse); one answering 0 made it act ~12 s late."""
    decisions, acted, onset = replay("collapse-29-to-2.5-gib-in-9s", hook={HOSTILE_START: claim})
    assert len(decisions) == 1 and acted == ["run /bin/true"], decisions
    assert decisions[0].time - onset <= 3.0, f"acted {decisions[0].time - onset:.0f} s after the collapse began"


def test_engine_start_claims_are_bounded_by_zero_and_the_nodes_memory():
    values = {HOSTILE_START: -5.0, HOSTILE_START.replace("4242", "1"): 1e300,
              HOSTILE_START.replace("4242", "2"): float("nan"), HOSTILE_START.replace("4242", "3"): 7.0,
              "memtel_allocator_reserved_bytes{rank=\"0\"}": -1.0}
    assert start_remaining_bytes(values, 100.0) == {HOSTILE_START: 0.0, HOSTILE_START.replace("4242", "1"): 100.0,
                                                     HOSTILE_START.replace("4242", "3"): 7.0}


@pytest.mark.parametrize("name", BENIGN)
def test_protect_does_nothing_on_a_benign_timeline(name):
    decisions, acted, _ = replay(name)
    assert decisions == [] and acted == []


def test_a_start_out_of_the_page_cache_taken_byte_for_byte_acts_and_measured_as_the_headroom_does_not():
    """Issue 38: the headroom counts the page cache at the huge-page success ratio (0.88 here); a start's remaining
    bytes taken byte for byte leave it 2-3 GiB below Low's floor, so protect killed a healthy start."""
    name = "spark-headless-start-0.90-cold-page-cache"
    decisions, _, _ = replay(name, discount=False)
    assert len(decisions) == 1
    after = decisions[0].evidence.after_starts_bytes
    assert after is not None and after < FALLING.low_floor_bytes
    assert replay(name) == ([], [], load_timeline(CORPUS / f"{name}.jsonl.gz").start)


def test_dry_run_is_the_default_and_only_says_what_it_would_do():
    config = from_mapping({"protect": {"enabled": True, "pidfile": "/run/vllm.pid"}}).protect
    assert config.dry_run is True and from_mapping({}).protect.enabled is False
    decisions, acted, _ = replay("collapse-29-to-2.5-gib-in-9s", dry_run=True)
    assert [d.decision for d in decisions] == ["would_act"] and acted == []


@pytest.mark.parametrize("section, message", [
    ({"enabled": True, "command": "pkill -f vllm"}, "protect.command: expected a list of arguments"),
    ({"enabled": True, "command": ["pkill", "vllm"]}, "protect.command[0]: expected an absolute path"),
    ({"enabled": True, "command": []}, "protect.command: expected a list of 1 to"),
    ({"enabled": True}, "protect: enabled, but no action"),
    ({"enabled": True, "pidfile": "/run/a.pid", "role": "vllm"}, "give one signal target"),
    ({"enabled": True, "command": ["/bin/true"], "unit": "vllm"}, "give one action"),
    ({"enabled": True, "pidfile": "run/a.pid"}, "protect.pidfile: expected an absolute path"),
    ({"enabled": True, "unit": "--help"}, "is not a systemd unit name"),
    ({"enabled": True, "unit": "vllm", "signal": "SIGSEGV"}, "protect.signal: expected one of"),
    ({"enabled": "yes", "unit": "vllm"}, "protect.enabled"),
    ({"enabled": True, "unit": "vllm", "dryrun": False}, "unknown key"),
    ({"enabled": True, "unit": "vllm", "rearm_seconds": float("nan")}, "protect.rearm_seconds"),
])
def test_hostile_protect_config_is_one_clear_error(section, message):
    with pytest.raises(ConfigError) as error:
        from_mapping({"protect": section})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_command_runs_as_an_argument_list(tmp_path):
    marker = tmp_path / "ran"
    config = ProtectConfig(enabled=True, dry_run=False,
                           command=(sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x; rm -rf /')"))
    assert run_action(config, {}).startswith("ran ")
    assert marker.read_text() == "x; rm -rf /"  # the argument arrived as text, no shell saw it
    failing = ProtectConfig(enabled=True, dry_run=False, command=(sys.executable, "-c", "raise SystemExit(3)"))
    with pytest.raises(ActionError, match="exited 3"):
        run_action(failing, {})


def test_a_signal_through_a_pidfile_reaches_the_process(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pidfile = tmp_path / "server.pid"
        pidfile.write_text(f"{child.pid}\n")
        config = ProtectConfig(enabled=True, dry_run=False, target_kind="pidfile", target=str(pidfile))
        assert f"pid {child.pid}" in run_action(config, {})
        assert child.wait(timeout=10) == -15
    finally:
        child.kill()
        child.wait()


def test_a_pidfile_that_is_a_symlink_or_not_a_pid_is_refused(tmp_path):
    real = tmp_path / "real.pid"
    real.write_text(f"{os.getppid()}\n")
    link = tmp_path / "link.pid"
    link.symlink_to(real)
    with pytest.raises(ActionError, match="symlink"):
        read_pidfile(str(link))
    (tmp_path / "dir.pid").mkdir()
    with pytest.raises(ActionError, match="not a regular file"):
        read_pidfile(str(tmp_path / "dir.pid"))
    junk = tmp_path / "junk.pid"
    junk.write_text("12 13\n")
    with pytest.raises(ActionError, match="does not hold one process id"):
        read_pidfile(str(junk))
    open_to_all = tmp_path / "open.pid"
    open_to_all.write_text("1234\n")
    open_to_all.chmod(0o666)
    with pytest.raises(ActionError, match="written by others"):
        read_pidfile(str(open_to_all))
    init = tmp_path / "init.pid"
    init.write_text("1\n")
    config = ProtectConfig(enabled=True, dry_run=False, target_kind="pidfile", target=str(init))
    with pytest.raises(ActionError, match="init or the daemon itself"):
        run_action(config, {})


def test_a_failed_action_is_a_counted_decision_not_a_crash(tmp_path):
    readings = iter([(29 * 2**30 - i * 3 * 2**30, 120 * 2**30) for i in range(12)])
    clock = iter(range(100, 200))
    config = ProtectConfig(enabled=True, dry_run=False, target_kind="pidfile", target=str(tmp_path / "missing.pid"))
    protect = Protect(config, lambda: next(readings), clock=lambda: float(next(clock)))
    decisions = [d for _ in range(9) if (d := protect.step()) is not None]
    assert [d.decision for d in decisions] == ["failed"] and "missing.pid" in decisions[0].detail
    families = {f.name: f for f in protect.collect()}
    counts = {s.labels["decision"]: s.value for s in families["memtel_protect_decisions"].samples
              if s.name.endswith("_total")}
    assert counts == {"acted": 0, "would_act": 0, "failed": 1}
    assert families["memtel_protect_last_decision_headroom_bytes"].samples[0].value < 29 * 2**30


# -- in the real daemon ---------------------------------------------------------------------------------------
def test_the_daemon_runs_protect_in_dry_run_and_exports_its_state(tmp_path):
    from tests.daemon.helpers import Daemon

    config = tmp_path / "daemon.yaml"
    config.write_text("protect:\n  enabled: true\n  command: [/bin/true]\n")
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    with Daemon(tmp_path / "state", "--config", str(config), "--kmsg", str(kmsg), "--disable-collector", "nvml",
                "--no-flight-recorder") as daemon:
        scrape = daemon.scrape()
        log = daemon.log()
    assert scrape.value("memtel_protect_dry_run") == 1
    assert scrape.value("memtel_protect_decisions_total", decision="acted") == 0
    assert scrape.value("memtel_protect_episode_active") == 0
    assert scrape.value("memtel_collector_success", collector="protect") == 1
    assert "protect on (dry run, will run /bin/true once per falling-headroom episode; engine starts read from no " \
           "hook exporter)" in log


def test_a_hostile_protect_section_stops_the_daemon_before_it_starts(tmp_path):
    from tests.daemon.helpers import run_cli

    config = tmp_path / "daemon.yaml"
    config.write_text("protect:\n  enabled: true\n  command: 'kill -9 $(pidof vllm)'\n")
    result = run_cli("--config", str(config), "--check-config")
    assert result.returncode == 2 and result.stdout == ""
    assert "protect.command: expected a list of arguments" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def _wait_argv(process: subprocess.Popen, word: str, deadline_s: float = 10.0) -> None:
    """Until the process's command line shows `word`. Popen returns once the kernel has closed the close-on-exec
    pipe, which is before the new program's arguments are in place: /proc/PID/cmdline can still read empty."""
    import time

    import psutil

    end = time.monotonic() + deadline_s
    while word not in psutil.Process(process.pid).cmdline():
        assert time.monotonic() < end, "the child's command line never showed its marker"
        time.sleep(0.01)


def test_a_signal_to_a_process_collector_role_reaches_its_processes():
    import re

    marker = "memtel-protect-role-test-7f3a"
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(60)", marker])
    try:
        _wait_argv(child, marker)
        config = ProtectConfig(enabled=True, dry_run=False, signal="SIGUSR1", target_kind="role", target="victim",
                               user=os.getuid())
        assert f"pid {child.pid}" in run_action(config, {"victim": re.compile(re.escape(marker))})
        assert child.wait(timeout=10) == -10
        with pytest.raises(ActionError, match=f"no process of uid {os.getuid()} has role victim"):
            run_action(config, {"victim": re.compile(re.escape(marker))})
        with pytest.raises(ActionError, match="is not one of the process collector's roles"):
            run_action(config, {})
    finally:
        child.kill()
        child.wait()


NOBODY = 65534


def _titled(title: str, user: int | None = None) -> subprocess.Popen:
    """A sleeping process whose command line starts with `title` (bash's exec -a), run as `user`."""
    return subprocess.Popen(["/bin/bash", "-c", f"exec -a {title} /bin/sleep 60"], user=user)


def _wait_titled(processes: list[subprocess.Popen], deadline_s: float = 10.0) -> None:
    """Until each process has exec'd into its title (bash first runs under its own command line)."""
    import time

    import psutil

    end = time.monotonic() + deadline_s
    for process in processes:
        while psutil.Process(process.pid).cmdline()[:1] in ([], ["/bin/bash"]):
            assert time.monotonic() < end, "a titled process did not start"
            time.sleep(0.01)


@pytest.mark.skipif(os.geteuid() != 0, reason="starts processes of another user")
def test_a_role_target_signals_only_the_engines_owner_and_is_never_filled_by_decoys():
    """Issue 41: 16 processes of any user titled like the engine filled the role's 16 places; the engine was
    never signalled. Now only the owner's processes match, however many decoys there are."""
    import re

    decoys = [_titled("VLLM::EngineCore-decoy", NOBODY) for _ in range(17)]
    engine = _titled("VLLM::EngineCore-7f3a")
    try:
        _wait_titled([*decoys, engine])
        config = from_mapping({"protect": {"enabled": True, "dry_run": False, "role": "engine_core", "user": 0,
                                           "signal": "SIGUSR1"}}).protect
        assert config.user == 0
        done = run_action(config, {"engine_core": re.compile(r"^VLLM::EngineCore")})
        assert f"pid {engine.pid} " in done and engine.wait(timeout=10) == -10
        assert all(decoy.poll() is None for decoy in decoys) and not any(str(d.pid) in done for d in decoys)
    finally:
        for process in (*decoys, engine):
            process.kill()
            process.wait()


@pytest.mark.parametrize("section, message", [
    ({"enabled": True, "role": "nosuchrole", "user": "root"},
     "protect.role: 'nosuchrole' is not one of the process collector's roles (api_server, engine_core, worker"),
    ({"enabled": True, "role": "worker"}, "protect.user: a role target needs the user that runs the engine"),
    ({"enabled": True, "role": "worker", "user": "no-such-user-7f3a"}, "protect.user: no user 'no-such-user-7f3a'"),
    ({"enabled": True, "unit": "vllm", "user": "root"}, "protect.user: only a role target takes a user"),
])
def test_a_role_target_names_a_known_role_and_the_engines_owner_at_check_config(tmp_path, section, message):
    from tests.daemon.helpers import check_config

    config = tmp_path / "daemon.yaml"
    config.write_text(yaml.safe_dump({"protect": section}))
    result = check_config("--config", str(config))
    assert result.returncode == 2 and result.stdout == ""
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
