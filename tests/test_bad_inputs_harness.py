"""Issue 16, cases 4, 9 and 11 on the harness's and the lab's command lines: every bad input is one line and
exit 2, in bounded memory, with nothing half-started.

Before: NaN and Inf passed ladder validation and failed after the run had started; non-UTF-8 and
giant-integer files, a `results.jsonl` line lacking fields (`ab report`, `--resume`) and
`lab serve --port 99999` ended in a Python traceback; `replay --layers 1e9` printed an empty message;
a ladder could make the harness build a structure larger than the machine ("billion laughs" in
`request.extra_body`, `tokens: 1e21`, `repeats: 1e12`, `words_file: /dev/zero`), and so could
`allocsim /dev/zero`, `replay --tokens 1e12` and `replay --layers 1e9`; `replay --plot /tmp` wrote
`/tmp.png`.

Each input runs in a fresh, empty working directory. Most go through the CLI's entry function
`telemetry.cli.main` in this process (what the `memtel` console script calls; its return value is the exit
status). The cases that ask for more memory than the machine has run the real `memtel` console script under an
address-space limit of 1.5 GiB (a structure of 10^12 anything cannot fit, so a case that tries ends in a
MemoryError traceback or a kill, and fails here), each within 10 s; so do the FIFO cases (a subprocess can be
timed out, a blocked call in this process cannot) and a few plain ones, for the exit status the shell sees.
After each: exit 2, exactly one line on stderr naming the command, no traceback, the working directory still
empty, no run directory and no served command started (the ladder's server would leave a marker file).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from telemetry import cli, limits
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
MEMTEL = Path(sys.executable).with_name("memtel")
ADDRESS_SPACE_LIMIT = 1536 << 20  # 1.5 GiB: far above what any refusal needs, far below 10^12 of anything
TIMEOUT_S = 60
RECORDS_FIXTURE = ROOT / "tests" / "ab" / "fixtures" / "cpu-vllm-repeats" / "results.jsonl"

LAUGHS = ("model: m\n"
          "arms: [{name: a, url: 'http://127.0.0.1:9'}]\n"
          "request:\n  extra_body:\n    l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
          + "".join(f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10)))


@dataclass
class Case:
    name: str
    argv: list[str]  # after `memtel`; {tmp} is the case's own scratch directory (outside the working directory)
    expect: str = ""  # a piece of the one line
    untouched: Path | None = None  # a directory the command must leave as it was


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))


def _base_ladder(marker: Path) -> dict:
    """A valid ladder whose served arm would leave `marker` if the harness ever started it."""
    return {
        "model": "tiny",
        "request": {"max_tokens": 4, "check_answer": False},
        "arms": [{"name": "a", "serve": {
            "command": [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('started')"],
            "health_url": f"http://127.0.0.1:{free_port()}/health", "startup_timeout_s": 5}}],
        "steps": [{"label": "s", "tokens": 1000, "seed": 1}],
    }


@dataclass(frozen=True)
class Raw:
    """YAML text written as is where a value goes (an integer too long for Python to write)."""

    text: str


def _set(path: str, value) -> Callable[[dict], None]:
    """A change of the base ladder: `path` (dotted, with [i]) set to `value`."""

    def change(data: dict) -> None:
        keys: list = []
        for part in path.split("."):
            name, _, index = part.partition("[")
            keys.append(name)
            if index:
                keys.append(int(index.rstrip("]")))
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
        node[keys[-1]] = "@@raw@@" if isinstance(value, Raw) else value

    change.raw = value.text if isinstance(value, Raw) else ""  # type: ignore[attr-defined]
    return change


def _ladder_changes(scratch: Path) -> dict[str, Callable[[dict], None] | bytes]:
    """Bad ladders: a change of the base ladder, or the file's bytes."""
    non_utf8_words = scratch / "words-latin1.txt"
    non_utf8_words.write_bytes("caf\xe9 na\xefve\n".encode("latin-1") * 10)
    return {
        # case 4: memory exhaustion
        "extra_body billion laughs": LAUGHS.encode(),
        "tokens 1e21 (float)": _set("steps[0].tokens", 1e21),
        "tokens 1e21 (text)": b"model: m\narms: [{name: a, url: 'http://127.0.0.1:9'}]\n"
                              b"steps: [{label: s, tokens: 1e21, seed: 1}]\n",
        "tokens 10^21 (integer)": _set("steps[0].tokens", 10**21),
        "repeats 1e12": _set("repeats", 1e12),
        "repeats 10^12": _set("repeats", 10**12),
        "words_file /dev/zero": _set("request.words_file", "/dev/zero"),
        "words_file a directory": _set("request.words_file", str(scratch)),
        "words_file missing": _set("request.words_file", str(scratch / "missing.txt")),
        "words_file not UTF-8": _set("request.words_file", str(non_utf8_words)),
        "extra_body 100 kB": _set("request.extra_body", {"x": "y" * 100_000}),
        "max_tokens 10^12": _set("request.max_tokens", 10**12),
        "one step over the limit": _set("steps", [{"label": f"s{i}", "tokens": 1000, "seed": i}
                                                  for i in range(limits.MAX_STEPS + 1)]),
        # case 9: NaN, infinity, giant integers, non-UTF-8
        "tokens NaN": _set("steps[0].tokens", float("nan")),
        "tokens infinity": _set("steps[0].tokens", float("inf")),
        "repeats NaN": _set("repeats", float("nan")),
        "temperature NaN": _set("request.temperature", float("nan")),
        "timeout_s infinity": _set("request.timeout_s", float("inf")),
        "needle_depth NaN": _set("request.needle_depth", float("nan")),
        "sample_interval_s NaN": _set("sample_interval_s", float("nan")),
        "step timeout_s NaN": _set("steps[0].timeout_s", float("nan")),
        "startup_timeout_s infinity": _set("arms[0].serve.startup_timeout_s", float("inf")),
        "stop_grace_s NaN": _set("arms[0].serve.stop_grace_s", float("nan")),
        "extra_body NaN": _set("request.extra_body", {"x": float("nan")}),
        "gate NaN": _set("gates", [{"arm": "a", "max_reserved_growth_mib": float("nan")}]),
        "seed 5,000 digits": _set("steps[0].seed", Raw("9" * 5000)),
        "seed 2^70": _set("steps[0].seed", 2**70),
        "tokens 40 digits": _set("steps[0].tokens", int("9" * 40)),
        "ladder not UTF-8": b"model: \"\xff\xfe\"\narms: [{name: a, url: 'http://127.0.0.1:9'}]\n",
        "ladder nested 5,000 deep": b"model: " + b"[" * 5000 + b"]" * 5000 + b"\n",
        "ladder of 2 MB": b"# " + b"x" * (2 << 20) + b"\n",
        "ladder a list": b"- model\n- arms\n",
        "recursive alias": b"model: m\narms: &a [{name: a, url: 'http://127.0.0.1:9', ranks: *a}]\n",
        # case 5: names that become paths
        "step label ../../../x": _set("steps[0].label", "../../../x"),
        "step label /abs/x": _set("steps[0].label", "/abs/x"),
        "step label of 200 characters": _set("steps[0].label", "l" * 200),
        "arm name ../x": _set("arms[0].name", "../x"),
        "arm name a/b": _set("arms[0].name", "a/b"),
        "serve.log_file ../../x.log": _set("arms[0].serve.log_file", "../../x.log"),
        "serve.log_file absolute": _set("arms[0].serve.log_file", str(scratch / "x.log")),
        # other fields
        "health_url port 99999": _set("arms[0].serve.health_url", "http://127.0.0.1:99999/health"),
        "health_url unclosed IPv6 bracket": _set("arms[0].serve.health_url", "http://[::1:8000/health"),
        "env value with NUL": _set("arms[0].serve.env", {"X": "a\0b"}),
        "65 arms": _set("arms", [{"name": f"a{i}", "url": "http://127.0.0.1:9"} for i in range(65)]),
    }


def _cases(scratch: Path) -> list[Case]:
    cases: list[Case] = []
    marker = scratch / "server-started"
    for name, change in _ladder_changes(scratch).items():
        path = scratch / f"ladder-{len(cases)}.yaml"
        if isinstance(change, bytes):
            path.write_bytes(change)
        else:
            data = _base_ladder(marker)
            change(data)
            text = yaml.safe_dump(data, sort_keys=False, width=1 << 30)
            path.write_text(text.replace("'@@raw@@'", getattr(change, "raw", "")))
        cases.append(Case(f"ab run: {name}", ["ab", "run", str(path), "--out", "run"], str(path)))
    fifo = scratch / "ladder.fifo"
    os.mkfifo(fifo)
    cases += [
        Case("ab run: the ladder is a FIFO", ["ab", "run", str(fifo), "--out", "run"]),
        Case("ab run: the ladder is /dev/zero", ["ab", "run", "/dev/zero", "--out", "run"]),
        Case("ab run: the ladder is a directory", ["ab", "run", str(scratch), "--out", "run"]),
        Case("ab run: the ladder is missing", ["ab", "run", str(scratch / "missing.yaml"), "--out", "run"]),
    ]

    # ab report and --resume on results.jsonl lines that cannot be read
    good_ladder = scratch / "good-ladder.yaml"
    good_ladder.write_text(yaml.safe_dump(_base_ladder(marker), sort_keys=False))
    fixture = RECORDS_FIXTURE.read_text().splitlines()
    request_line = next(i for i, line in enumerate(fixture) if '"event": "request"' in line)
    run_start_line = next(i for i, line in enumerate(fixture) if '"event": "run_start"' in line)

    def run_dir(name: str, lines: list[str] | bytes) -> Path:
        path = scratch / name
        path.mkdir()
        target = path / "results.jsonl"
        if isinstance(lines, bytes):
            target.write_bytes(lines)
        else:
            target.write_text("\n".join(lines) + "\n")
        return path

    def without(index: int, field: str) -> list[str]:
        record = json.loads(fixture[index])
        del record[field]
        return [*fixture[:index], json.dumps(record), *fixture[index + 1:]]

    def with_value(index: int, field: str, value: str) -> list[str]:
        line = json.dumps({**json.loads(fixture[index]), field: "@@"}).replace('"@@"', value)
        return [*fixture[:index], line, *fixture[index + 1:]]

    broken = {
        "request without started_at": without(request_line, "started_at"),
        "request without arm": without(request_line, "arm"),
        "run_start without its ladder": without(run_start_line, "ladder"),
        "a request's ttft NaN": with_value(request_line, "ttft_s", "NaN"),
        "a request's repeat 5,000 digits": with_value(request_line, "repeat", "9" * 5000),
        "not UTF-8": b'{"event": "run_start", "ts": 1.0, "x": "\xff\xfe"}\n',
        "a line nested 100,000 deep": ("[" * 100_000 + "]" * 100_000 + "\n").encode(),
    }
    for name, lines in broken.items():
        path = run_dir(f"report-{len(cases)}", lines)
        cases.append(Case(f"ab report: results.jsonl {name}", ["ab", "report", str(path)], "results.jsonl",
                          untouched=path))
        resume = run_dir(f"resume-{len(cases)}", lines)
        cases.append(Case(f"ab run --resume: results.jsonl {name}",
                          ["ab", "run", str(good_ladder), "--out", str(resume), "--resume"], "results.jsonl",
                          untouched=resume))
    cases += [
        Case("ab report: no such directory", ["ab", "report", str(scratch / "missing")]),
        Case("ab report: a file, not a directory", ["ab", "report", str(good_ladder)]),
        Case("ab run: --out is a file", ["ab", "run", str(good_ladder), "--out", str(good_ladder)]),
    ]

    # allocsim, replay, forecast, whatif
    not_utf8 = scratch / "ops-latin1.json"
    not_utf8.write_bytes(b'{"cases": "\xff"}')
    giant = scratch / "ops-giant.json"
    giant.write_text('{"cases": [{"ops": [{"op": "malloc", "size": ' + "9" * 5000 + "}]}]}")
    nan_ops = scratch / "ops-nan.json"
    nan_ops.write_text('{"cases": [{"ops": [{"op": "malloc", "size": NaN}]}]}')
    deep = scratch / "ops-deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    cases += [
        Case("allocsim /dev/zero", ["allocsim", "/dev/zero"], "/dev/zero"),
        Case("allocsim a directory", ["allocsim", str(scratch)]),
        Case("allocsim a missing file", ["allocsim", str(scratch / "missing.json")]),
        Case("allocsim a FIFO", ["allocsim", str(fifo)]),
        Case("allocsim not UTF-8", ["allocsim", str(not_utf8)]),
        Case("allocsim a 5,000-digit size", ["allocsim", str(giant)]),
        Case("allocsim a NaN size", ["allocsim", str(nan_ops)]),
        Case("allocsim nested 100,000 deep", ["allocsim", str(deep)]),
        Case("allocsim --capacity-gb nan", ["allocsim", "--capacity-gb", "nan", str(RECORDS_FIXTURE)], "--capacity-gb"),
        Case("allocsim --max-file-gb inf", ["allocsim", "--max-file-gb", "inf", "--from-snapshot", "/dev/zero",
                                            str(RECORDS_FIXTURE)], "--max-file-gb"),
        Case("replay --tokens 1e12", ["replay", "--allocator", "sim", "--tokens", "1e12"], "--tokens"),
        Case("replay --tokens 10^12", ["replay", "--allocator", "sim", "--tokens", "1000000000000"], "--tokens"),
        Case("replay --layers 1e9", ["replay", "--allocator", "sim", "--layers", "1e9"], "--layers"),
        Case("replay --layers 10^9", ["replay", "--allocator", "sim", "--layers", "1000000000"], "--layers"),
        Case("replay --tokens in Arabic-Indic digits", ["replay", "--allocator", "sim", "--tokens", "١٢٣٤"],
             "--tokens"),
        Case("replay --budget-mb nan", ["replay", "--allocator", "sim", "--budget-mb", "nan"], "--budget-mb"),
        Case("replay --budget-mb inf", ["replay", "--allocator", "sim", "--budget-mb", "inf"], "--budget-mb"),
        Case("replay --transient-mb 1e300", ["replay", "--allocator", "sim", "--transient-mb", "1e300"],
             "--transient-mb"),
        Case("replay --max-model-len 10^30", ["replay", "--allocator", "sim", "--max-model-len", "1" + "0" * 30],
             "--max-model-len"),
        Case("replay --chunk 0", ["replay", "--allocator", "sim", "--chunk", "0"], "--chunk"),
        Case("replay --topk 10^9", ["replay", "--allocator", "sim", "--topk", "1000000000"], "--topk"),
        Case("replay --capacity-gb nan", ["replay", "--allocator", "sim", "--capacity-gb", "nan"], "--capacity-gb"),
        Case("replay many small launches", ["replay", "--allocator", "sim", "--tokens", "4194304", "--chunk", "1",
                                            "--max-model-len", "4194304"]),
        Case("replay --arm 17 times", ["replay", "--allocator", "sim", *(["--arm", "stock"] * 17)], "--arm"),
        Case("replay --plot /tmp (a directory)",
             ["replay", "--allocator", "sim", "--tokens", "20000", "--plot", "/tmp"], "--plot"),
        Case("replay --record is a directory", ["replay", "--allocator", "sim", "--tokens", "20000", "--record",
                                                str(scratch)], "--record"),
        Case("replay --out is a file", ["replay", "--allocator", "sim", "--tokens", "20000", "--out",
                                        str(good_ladder)], "--out"),
        Case("forecast --snapshot /dev/zero", ["forecast", "--snapshot", "/dev/zero", "--tokens", "1000"], "/dev/zero"),
        Case("forecast --tokens 1e12", ["forecast", "--snapshot", str(RECORDS_FIXTURE), "--tokens", "1e12"],
             "--tokens"),
        Case("forecast --tokens empty", ["forecast", "--snapshot", str(RECORDS_FIXTURE), "--tokens", ""], "--tokens"),
        Case("forecast 65 token counts", ["forecast", "--snapshot", str(RECORDS_FIXTURE), "--tokens",
                                          ",".join(["1000"] * 65)], "--tokens"),
        Case("forecast --max-file-gb nan", ["forecast", "--snapshot", "/dev/zero", "--tokens", "1000", "--max-file-gb",
                                            "nan"], "--max-file-gb"),
        Case("whatif /dev/zero", ["whatif", "/dev/zero"], "/dev/zero"),
        Case("whatif a directory", ["whatif", str(scratch)]),
        Case("whatif --capacity-gb inf", ["whatif", "--capacity-gb", "inf", "/dev/zero"], "--capacity-gb"),
        Case("whatif --plot /tmp (a directory)", ["whatif", "--plot", "/tmp", "/dev/zero"], "--plot"),
    ]

    # lab serve, demo, run
    serve = ["lab", "serve", "--arm", "stock", "--allocator", "sim", "--host", "127.0.0.1"]
    demo_run = scratch / "demo-run"
    demo_run.mkdir()
    (demo_run / "results.jsonl").write_text('{"event": "run_start"}\n')
    cases += [
        # The demo has no --resume: its line says what it takes (it said "pass --resume", then rejected it).
        Case("demo --out holds a run", ["demo", "--out", str(demo_run)], "pass --overwrite to replace it",
             untouched=demo_run),
        Case("lab serve --port 99999", [*serve, "--port", "99999"], "--port"),
        Case("lab serve --port -1", [*serve, "--port", "-1"], "--port"),
        Case("lab serve --port in Arabic-Indic digits", [*serve, "--port", "٨٠٠٠"], "--port"),
        Case("lab serve --memtel-port 70000", [*serve, "--memtel-port", "70000"], "--memtel-port"),
        Case("lab serve --hook-listen :0", [*serve, "--hook-listen", "127.0.0.1:0"], "--hook-listen"),
        Case("lab serve --hook-listen 65535 with 2 ranks", [*serve, "--ranks", "2", "--hook-listen", "127.0.0.1:65535"],
             "--hook-listen"),
        Case("lab serve --hook-listen and --memtel-port", [*serve, "--hook-listen", "127.0.0.1:9300", "--memtel-port",
                                                           "9300"], "--hook-listen"),
        Case("lab serve --listen and --port", ["lab", "serve", "--arm", "stock", "--allocator", "sim", "--listen",
                                               "127.0.0.1:8000", "--port", "8001"], "--listen"),
        Case("lab serve --ranks 10^9", [*serve, "--ranks", "1000000000"], "--ranks"),
        Case("lab serve --layers 1e9", [*serve, "--layers", "1e9"], "--layers"),
        Case("lab serve --scale nan", [*serve, "--scale", "nan"], "--scale"),
        Case("lab serve --time-scale inf", [*serve, "--time-scale", "inf"], "--time-scale"),
        Case("lab serve --budget-mb nan", [*serve, "--budget-mb", "nan"], "--budget-mb"),
        Case("lab serve --max-model-len 10^30", [*serve, "--max-model-len", "1" + "0" * 30], "--max-model-len"),
        Case("demo --scale 0", ["demo", "--scale", "0"], "--scale"),
        Case("demo --scale nan", ["demo", "--scale", "nan"], "--scale"),
        Case("demo --steps 1e12", ["demo", "--steps", "1e12"], "--steps"),
        Case("demo --steps 10^12", ["demo", "--steps", "1000000000000"], "--steps"),
        Case("demo --steps in full-width digits", ["demo", "--steps", "１００００"], "--steps"),
        Case("demo --steps empty", ["demo", "--steps", ""], "--steps"),
        Case("demo --ranks 10^6", ["demo", "--ranks", "1000000"], "--ranks"),
        Case("demo --time-scale inf", ["demo", "--time-scale", "inf"], "--time-scale"),
        Case("demo --time-scale 2,000", ["demo", "--time-scale", "2000"], "--time-scale"),
        Case("demo --layers 1e9", ["demo", "--layers", "1e9"], "--layers"),
        Case("demo --out is a file", ["demo", "--out", str(good_ladder)], str(good_ladder)),
        Case("run --port 99999", ["run", "--targets", "lab-indexer", "--port", "99999", "--", "/bin/true"], "--port"),
        Case("run --port in Arabic-Indic digits", ["run", "--targets", "lab-indexer", "--port", "٩٢٠٠", "--",
                                                   "/bin/true"], "--port"),
        Case("run --unresolved-after nan", ["run", "--targets", "lab-indexer", "--unresolved-after", "nan", "--",
                                            "/bin/true"], "--unresolved-after"),
        Case("run --targets malformed", ["run", "--targets", "x:y:z", "--", "/bin/true"], "--targets"),
        Case("run without a command", ["run", "--targets", "lab-indexer"]),
    ]
    return cases


def _run(case: Case, cwd: Path) -> tuple[Case, Path, subprocess.CompletedProcess | str]:
    cwd.mkdir()
    before = _contents(case.untouched) if case.untouched else {}
    try:
        result = subprocess.run([str(MEMTEL), *case.argv], cwd=cwd, capture_output=True, text=True,
                                timeout=TIMEOUT_S, stdin=subprocess.DEVNULL, preexec_fn=_limit_address_space,
                                env={**os.environ, "MEMTEL_TARGETS": ""})
    except subprocess.TimeoutExpired:
        return case, cwd, f"still running after {TIMEOUT_S} s"
    if case.untouched and _contents(case.untouched) != before:
        return case, cwd, f"changed {case.untouched}: {sorted(_contents(case.untouched))}"
    return case, cwd, result


def _call(case: Case, cwd: Path, capfd: pytest.CaptureFixture[str],
          monkeypatch: pytest.MonkeyPatch) -> tuple[Case, Path, subprocess.CompletedProcess | str]:
    """`case` through `telemetry.cli.main` in this process, in `cwd`: what the console script would exit with
    and print. An exception out of `main` is what a traceback would have been."""
    cwd.mkdir()
    before = _contents(case.untouched) if case.untouched else {}
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    capfd.readouterr()
    with monkeypatch.context() as patch:
        patch.chdir(cwd)
        patch.setenv("MEMTEL_TARGETS", "")
        raised = ""
        try:
            code = cli.main(list(case.argv))
        except SystemExit as exit_:  # argparse, or a sys.exit() in a command: the console script's status
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
            if isinstance(exit_.code, str):
                raised = exit_.code + "\n"
        except Exception:  # the traceback the console script would print
            code, raised = 1, traceback.format_exc()
    out, err = capfd.readouterr()
    changed = [signum for signum, handler in handlers.items() if signal.getsignal(signum) != handler]
    for signum in changed:
        signal.signal(signum, handlers[signum])
    if changed:
        return case, cwd, f"left signal handlers changed: {changed}"
    if case.untouched and _contents(case.untouched) != before:
        return case, cwd, f"changed {case.untouched}: {sorted(_contents(case.untouched))}"
    return case, cwd, subprocess.CompletedProcess(case.argv, code, out, err + raised)


NESTED = ("ab", "lab", "flight", "alerts")  # commands with sub-subcommands


def _problem(case: Case, cwd: Path, result: subprocess.CompletedProcess | str) -> str | None:
    if isinstance(result, str):
        return result
    lines = result.stderr.strip().splitlines()
    # A sub-subcommand's line names it (`memtel lab serve: error: ...`, not `memtel lab: error: ...`).
    nested = case.argv[0] in NESTED and len(case.argv) > 1 and not case.argv[1].startswith("-")
    command = "memtel " + " ".join(case.argv[:2] if nested else case.argv[:1]) + ": "
    if result.returncode != 2:
        return f"exit {result.returncode}: {result.stderr[-300:]!r}"
    if "Traceback" in result.stderr or len(lines) != 1:
        return f"{len(lines)} lines on stderr: {result.stderr[-300:]!r}"
    if not lines[0].startswith(command) or len(lines[0]) < len(command) + 20:
        return f"the line does not name the command or says nothing: {lines[0]!r}"
    if case.argv[0] == "demo" and "--resume" in lines[0]:
        return f"the demo's line suggests --resume, which the demo rejects: {lines[0]!r}"
    if case.expect and case.expect not in lines[0]:
        return f"the line does not name {case.expect!r}: {lines[0]!r}"
    if any(cwd.iterdir()):
        return f"left files behind: {sorted(p.name for p in cwd.iterdir())}"
    return None


def _run_all(cases: list[Case], tmp_path: Path, workers: int = 3) -> dict[str, str]:
    """What went wrong with each case that was not one line and exit 2 (empty: all were)."""
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda ic: _run(ic[1], tmp_path / f"cwd-{ic[0]}"), enumerate(cases)))
    return {case.name: problem for case, cwd, result in results
            if (problem := _problem(case, cwd, result)) is not None}


# Through the real console script: FIFOs (must not block), and a few plain cases for the exit status itself.
SUBPROCESS_CASES = ("ab run: the ladder is a FIFO", "allocsim a FIFO", "ab run: tokens NaN",
                    "ab report: no such directory", "replay --chunk 0", "lab serve --port 99999", "demo --scale 0",
                    "run without a command")


def test_every_bad_harness_input_is_one_line_and_exit_2_never_a_traceback(tmp_path, capfd, monkeypatch):
    """Every case but MEMORY_CASES (the next test runs those, in bounded memory): in this process, and
    SUBPROCESS_CASES through the console script."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cases = _cases(scratch)
    assert len({c.name for c in cases}) == len(cases)
    assert {c.name for c in cases} >= {*MEMORY_CASES, *SUBPROCESS_CASES}
    before_tmp_png = Path("/tmp.png").exists()
    in_process = [c for c in cases if c.name not in MEMORY_CASES and c.name not in SUBPROCESS_CASES]
    results = [_call(case, tmp_path / f"in-{i}", capfd, monkeypatch) for i, case in enumerate(in_process)]
    bad = {case.name: problem for case, cwd, result in results if (problem := _problem(case, cwd, result)) is not None}
    bad |= _run_all([c for c in cases if c.name in SUBPROCESS_CASES], tmp_path)
    tried = len(in_process) + len(SUBPROCESS_CASES)
    print(f"{tried} bad harness inputs tried, {tried - len(bad)} answered with one line and exit 2")
    assert bad == {}, "\n".join(f"{name}: {problem}" for name, problem in bad.items())
    assert not (scratch / "server-started").exists()  # no served command ever started
    assert Path("/tmp.png").exists() == before_tmp_png
    assert len(cases) >= 100


MEMORY_CASES = ("ab run: extra_body billion laughs", "ab run: tokens 1e21 (float)", "ab run: tokens 1e21 (text)",
                "ab run: repeats 1e12", "ab run: repeats 10^12", "ab run: words_file /dev/zero", "allocsim /dev/zero",
                "replay --tokens 1e12", "replay --tokens 10^12", "replay --layers 1e9", "replay --layers 10^9",
                "replay many small launches", "ab run: the ladder is /dev/zero", "forecast --snapshot /dev/zero",
                "whatif /dev/zero")


def test_a_ladder_or_flag_asking_for_more_memory_than_the_machine_fails_in_seconds_in_bounded_memory(tmp_path):
    """Case 4 alone, two at a time (one per core): each under its own 1.5 GiB of address space, each refused
    within 10 s (a few hundred milliseconds each when the machine is idle)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cases = [c for c in _cases(scratch) if c.name in MEMORY_CASES]
    assert len(cases) == len(MEMORY_CASES)

    def timed(i: int, case: Case) -> tuple[Case, Path, subprocess.CompletedProcess | str, float]:
        started = time.monotonic()
        _case, cwd, result = _run(case, tmp_path / f"cwd-{i}")
        return case, cwd, result, time.monotonic() - started

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(timed, range(len(cases)), cases))
    for case, cwd, result, elapsed in results:
        assert _problem(case, cwd, result) is None, (case.name, _problem(case, cwd, result))
        assert elapsed < 10, (case.name, elapsed)
