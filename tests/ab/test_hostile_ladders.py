"""Issue 16, cases 5, 6, 7 and 11 on a real `memtel ab run` (and `memtel replay`): what a hostile ladder found.

- 5: a step label `../../../x` or `/abs/x` wrote the prompt file outside the run directory (arm names were
  checked, labels not); a symbolic link planted in the run directory is refused too.
- 6: `serve.env` values and URL credentials landed in results.jsonl (3–4 times) and report.md, world-readable.
- 7: `--resume` left a server running when it had been started from a console script (its command line
  starts with the interpreter, so the command-line match missed it); the resume then failed on "port already
  in use".
- 11: `replay --plot /tmp` wrote `/tmp.png`.

Served arms are lab servers on the simulator (tests/ab/lab.py), small enough to answer in seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.ab.serve import process_info
from tests.ab.lab import ROOT, events, harness, lab_arm, records, tail, wait_for

MEMTEL = Path(sys.executable).with_name("memtel")
SMALL = {"max_model_len": 16384, "chunk": 2048, "layers": 2, "budget_mb": "16", "scale": "0.25", "time_scale": "0"}
STEPS = [{"label": "s1", "tokens": 2000, "seed": 1}, {"label": "s2", "tokens": 3000, "seed": 2}]


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _ab(args: list[str], timeout: float = 300, umask: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(MEMTEL), "ab", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


def _files(top: Path) -> list[Path]:
    return sorted(p for p in top.rglob("*"))


# --- case 5 -----------------------------------------------------------------------------------------


def test_a_step_label_or_arm_name_that_leaves_the_run_directory_is_refused_before_anything_is_written(tmp_path):
    marker = tmp_path / "server-started"
    run_dir = tmp_path / "a" / "b" / "c" / "run"
    base = {"model": "lab", "request": {"max_tokens": 4, "check_answer": False},
            "arms": [{"name": "a", "serve": {"command": [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
                                             "health_url": "http://127.0.0.1:9/health", "startup_timeout_s": 5}}],
            "steps": [{"label": "s", "tokens": 1000, "seed": 1}]}
    bad = {
        "step label ../../../x": ("steps", 0, "label", "../../../x"),
        "step label /abs/x": ("steps", 0, "label", str(tmp_path / "abs" / "x")),
        "step label .": ("steps", 0, "label", "."),
        "arm name ../../x": ("arms", 0, "name", "../../x"),
        "arm name /abs/x": ("arms", 0, "name", str(tmp_path / "abs" / "x")),
    }
    _write(tmp_path / "ladder.yaml", base)
    before = _files(tmp_path)
    for what, (key, index, field, value) in bad.items():
        data = yaml.safe_load(yaml.safe_dump(base))
        data[key][index][field] = value
        ladder = _write(tmp_path / "ladder.yaml", data)
        result = _ab(["run", str(ladder), "--out", str(run_dir)], timeout=60)
        assert result.returncode == 2, (what, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, (what, result.stderr)
        assert f"{key}[{index}].{field}: use letters, digits, '.', '_' or '-', starting with a letter or digit" \
            in lines[0], (what, lines[0])
        assert _files(tmp_path) == before, what  # nothing written, inside or outside the run directory
    assert not marker.exists()

    # A symbolic link planted in a run directory (prompts -> elsewhere) is refused before anything is written.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir.mkdir(parents=True)
    (run_dir / "prompts").symlink_to(elsewhere)
    ladder = _write(tmp_path / "ladder.yaml", base)
    result = _ab(["run", str(ladder), "--out", str(run_dir)], timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "outside the run directory" in result.stderr
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in run_dir.iterdir()) == ["prompts"]
    assert not marker.exists()


# --- case 6 -----------------------------------------------------------------------------------------

SECRETS = {
    "HF_TOKEN": "hf_Secr3tTokenValue77",
    "MY_DB_PASSWORD": "Hunter2-db-pass-91",
    "SERVICE_AUTH": "auth-3c4d5e6f7a",
    "OPENAI_API_KEY": "sk-lab-key-2b9e4f",
}
RANK_PASSWORD = "RankPw-998877"
HEALTH_PASSWORD = "HealthPw-556677"


def test_serve_env_secrets_and_url_credentials_never_reach_a_run_file_and_run_files_are_private(tmp_path):
    arm = lab_arm("stock", "stock", **SMALL)
    arm["serve"]["env"].update(SECRETS)
    arm["serve"]["env"]["SHORT_SECRET"] = "abc"  # too short to search for in text: hidden where it is named
    arm["serve"]["env"]["VISIBLE_SETTING"] = "kept-as-is-42"
    health = arm["serve"]["health_url"]
    arm["serve"]["health_url"] = health.replace("http://", f"http://probe:{HEALTH_PASSWORD}@")
    arm["ranks"] = {name: url.replace("http://", f"http://scraper:{RANK_PASSWORD}@")
                    for name, url in arm["ranks"].items()}
    ladder = _write(tmp_path / "ladder.yaml", {"model": "lab", "request": {"max_tokens": 4, "check_answer": False},
                                              "arms": [arm], "steps": STEPS})
    run_dir = tmp_path / "run"
    result = _ab(["run", str(ladder), "--out", str(run_dir)], umask=0o022)  # a permissive umask
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["ok"] for r in events(run_dir, "request")] == [True, True]

    secrets = [*SECRETS.values(), RANK_PASSWORD, HEALTH_PASSWORD]
    files = [p for p in _files(run_dir) if p.is_file()]
    assert {"results.jsonl", "report.md", "summary.json"} <= {p.name for p in files}
    assert any(p.name.endswith("-serve.log") for p in files) and any(".jsonl" in p.name for p in files
                                                                       if "hook-logs" in p.parts)
    leaks = {(str(p.relative_to(run_dir)), s) for p in files for s in secrets if s.encode() in p.read_bytes()}
    leaks |= {("console", s) for s in secrets if s in result.stdout + result.stderr}
    assert leaks == set()

    # What was recorded instead: *** for each secret, the rest as it was.
    start = events(run_dir, "serve_start")[0]
    assert all(start["env"][name] == "***" for name in [*SECRETS, "SHORT_SECRET"])
    assert start["env"]["VISIBLE_SETTING"] == "kept-as-is-42"
    run_start = events(run_dir, "run_start")[0]
    recorded_arm = run_start["ladder"]["arms"][0]
    assert recorded_arm["serve"]["health_url"] == health.replace("http://", "http://***@")
    assert all(url.startswith("http://***@127.0.0.1:") for url in recorded_arm["ranks"].values())
    report = (run_dir / "report.md").read_text()
    assert "HF_TOKEN=***" in report and "VISIBLE_SETTING=kept-as-is-42" in report

    # Private: 0600 files and 0700 directories the harness created, whatever the umask (the hook's own files
    # in hook-logs are the served process's, created private by the hook itself).
    loose = {str(p.relative_to(run_dir)): oct(stat.S_IMODE(p.stat().st_mode)) for p in [run_dir, *_files(run_dir)]
             if not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) & 0o077}
    assert loose == {}


# --- case 7 -----------------------------------------------------------------------------------------


def _watchdog_of(harness_pid: int) -> list[int]:
    """Pids of the serve watchdogs (`python -m harness.ab.serve watch HARNESS_PID ...`) of one harness."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"harness.ab.serve" in argv and b"watch" in argv and str(harness_pid).encode() in argv:
                found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_resume_stops_a_server_started_from_a_console_script_that_a_killed_run_left_running(tmp_path):
    arm = lab_arm("stock", "stock", **SMALL)
    command = arm["serve"]["command"]
    assert command[1:4] == ["-m", "telemetry", "lab"]
    arm["serve"]["command"] = [str(MEMTEL), *command[3:]]  # `memtel lab serve ...`: argv[0] is the interpreter
    # Steps after s1 keep the harness busy: at time scale 0 it finished the two steps and stopped its server
    # before it was killed in about one run in five (the server was already shutting down when resumed).
    more = [{"label": f"s{n}", "tokens": 12000, "seed": n} for n in range(3, 7)]
    ladder = _write(tmp_path / "ladder.yaml", {"model": "lab", "request": {"max_tokens": 4, "check_answer": False},
                                              "arms": [arm], "steps": [*STEPS, *more]})
    run_dir, log = tmp_path / "run", tmp_path / "harness.log"
    proc = harness(["run", str(ladder), "--out", str(run_dir)], log)
    leader = None
    try:
        start = wait_for(lambda: events(run_dir, "serve_start"), 120, "the server's start", proc, log)[0]
        wait_for(lambda: events(run_dir, "request", step="s1"), 120, "the first request", proc, log)
        os.kill(proc.pid, signal.SIGSTOP)   # the harness goes no further (its kill below ends it all the same)
        leader = start["pid"]
        info = process_info(leader)
        assert info is not None and info.start_time_ticks == start["start_time_ticks"]
        cmdline = Path(f"/proc/{leader}/cmdline").read_bytes().split(b"\0")
        assert cmdline[1].endswith(b"/memtel") and cmdline[0] != str(MEMTEL).encode()  # the interpreter first
        # Kill everything of the harness that could stop the server: its watchdog, then the harness itself.
        for pid in _watchdog_of(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)
        alive = process_info(leader)
        assert alive is not None and alive.state != "Z", "the server must still run for the case to be tested"
        assert "signal 15" not in (run_dir / "logs" / "stock-r0-serve.log").read_text(), "nothing stopped it yet"
        assert not events(run_dir, "serve_stop")

        result = _ab(["run", str(ladder), "--out", str(run_dir), "--resume"], timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "already in use" not in result.stderr
        assert f"(pid {leader}) was stopped" in result.stderr
        gone = process_info(leader)  # a zombie is dead too: its parent died, and its new one reaps it when it will
        assert gone is None or gone.state == "Z" or gone.start_time_ticks != start["start_time_ticks"]
        labels = [step["label"] for step in [*STEPS, *more]]   # the superseded block again, whole
        assert [(r["step"], r["ok"]) for r in events(run_dir, "request")][-len(labels):] == [(x, True) for x in labels]
        assert len(events(run_dir, "serve_start")) == 2 and len(events(run_dir, "block_superseded")) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if leader is not None and (info := process_info(leader)) is not None and info.pgid == leader:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader, signal.SIGKILL)
        for record in records(run_dir):  # the resumed run's server, should an assertion above have failed
            if record["event"] == "serve_start" and process_info(record["pid"]) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record["pgid"], signal.SIGKILL)
    print(tail(log, 5))


# --- case 11 ----------------------------------------------------------------------------------------


def test_replay_plot_to_a_directory_is_refused_instead_of_writing_a_png_beside_it(tmp_path):
    target = tmp_path / "plots"
    target.mkdir()
    result = subprocess.run([str(MEMTEL), "replay", "--allocator", "sim", "--tokens", "20000", "--plot", str(target)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"memtel replay: error: --plot writes a PNG file: give a path ending in .png, got {target}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots"] and list(target.iterdir()) == []
