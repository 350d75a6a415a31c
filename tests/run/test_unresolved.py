"""Unresolved targets under `memtel run`: reported once, on the exporter and in the log, where it matters.

The triggers (telemetry/run/boot.py): a serving engine's model-loaded signal (here an SGLang-shaped program:
SGLang itself needs CUDA), a process's first hooked call, and, when no process of the run has hooked anything,
a warning from the run's first process after --unresolved-after seconds (not in a serving engine) and at its
exit.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.run.conftest import PROGRAMS, announcements, listeners, memtel_run, memtel_run_command, scrape
from tests.support.ports import free_port_block

TARGET = "memtel_run_target:logits"
UNUSED = "memtel_run_unused:never_called"
DEEP_GEMM = "deep_gemm:fp8_mqa_logits"
TORCH_FALLBACK = "sglang.srt.layers.attention.dsa.utils:_fp8_mqa_logits_torch"

# SGLang's module layout and call pattern (sglang 0.5.23), small: see programs/sglang_shaped.py.
SGLANG_SHAPED = {
    "deep_gemm/__init__.py": """
        def fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
            return bytearray(q * kv * 4)   # float32 [rows, context]
    """,
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/layers/__init__.py": "",
    "sglang/srt/layers/deep_gemm_wrapper.py": "import deep_gemm  # noqa: F401  (SGLang imports it at start on CUDA)\n",
    "sglang/srt/layers/attention/__init__.py": "",
    "sglang/srt/layers/attention/dsa/__init__.py": "",
    "sglang/srt/layers/attention/dsa/utils.py": """
        from functools import lru_cache


        def _fp8_mqa_logits_torch(q, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
            return bytearray(q * kv * 4)


        @lru_cache(maxsize=1)
        def resolve_fp8_mqa_logits_fn():
            import deep_gemm

            return deep_gemm.fp8_mqa_logits
    """,
    "sglang/srt/layers/attention/dsa/dsa_indexer.py": """
        from sglang.srt.layers import deep_gemm_wrapper  # noqa: F401
        from sglang.srt.layers.attention.dsa.utils import resolve_fp8_mqa_logits_fn


        class Indexer:
            def prefill(self, rows, context):
                calls = 0
                for start in range(0, rows, 2):   # row chunks under a logits budget
                    resolve_fp8_mqa_logits_fn()(min(2, rows - start), context, None, None, None)
                    calls += 1
                return calls
    """,
    "sglang/srt/model_executor/__init__.py": "",
    "sglang/srt/model_executor/model_runner.py": """
        class Model:
            def __init__(self, layers):
                self.layers = layers

            def modules(self):
                return iter([self, *self.layers])


        class Norm:
            pass


        class ModelRunner:
            def __init__(self, with_indexer):
                self.with_indexer = with_indexer
                self.initialize()

            def initialize(self):
                self.load_model()

            def load_model(self):
                from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

                self.model = Model([Norm()] + ([Indexer()] if self.with_indexer else []))
    """,
}


def write_sglang_shaped(root: Path) -> Path:
    for name, text in SGLANG_SHAPED.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def unresolved_gauges(samples: dict[str, float]) -> dict[str, float]:
    return {key.split('target="', 1)[1].split('"', 1)[0]: value for key, value in samples.items()
            if key.startswith("memtel_hook_unresolved_targets{")}


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "hook targets not resolved" in line]


@pytest.mark.parametrize("with_indexer", [True, False], ids=["indexer-in-model", "no-indexer-in-model"])
def test_an_sglang_shaped_scheduler_reports_at_model_load(tmp_path, run_env, handshake, with_indexer):
    root = write_sglang_shaped(tmp_path / "sglang-shaped")
    base = free_port_block(4)
    env = {**run_env, "PYTHONPATH": f"{root}:{PROGRAMS}"}
    process = subprocess.Popen([*memtel_run_command("--targets", "sglang-sparse-indexer", "--port", str(base)), "--",
                                "python", str(PROGRAMS / "sglang_shaped.py"), str(handshake.directory),
                                "1" if with_indexer else "0", "3"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        (worker,) = handshake.wait_ready(1, process)
        samples = scrape(base)
    finally:
        handshake.go()
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    calls = {k: v for k, v in samples.items() if k.startswith("memtel_hook_calls_total{")}
    gauges = unresolved_gauges(samples)
    if with_indexer:
        # 3 prefill chunks of 4 rows, 2 rows per logits call: 6 calls through the cached resolver
        assert worker["calls"] == 6 and list(calls.values()) == [6.0] and DEEP_GEMM in next(iter(calls))
        assert gauges == {DEEP_GEMM: 0.0, TORCH_FALLBACK: 0.0}
        assert warnings(stderr) == []
    else:
        assert worker["calls"] == 0 and calls == {}
        assert gauges == {DEEP_GEMM: 1.0, TORCH_FALLBACK: 1.0}
        (warning,) = warnings(stderr)
        assert "2 of 2 hook targets not resolved after the model loaded" in warning
        assert (f"{DEEP_GEMM} (hooked, but the loaded model has no Indexer, IndexerKPool or C4Indexer layer: "
                "it never runs)") in warning
        assert f"{TORCH_FALLBACK} (hooked, but the loaded model has no Indexer layer: it never runs)" in warning
    (line,) = announcements(stderr).values()
    assert f"exporter: http://127.0.0.1:{base}/metrics" in line and "rank 0 (local rank 0, from run order)" in line


def test_targets_unresolved_at_a_process_first_hooked_call_are_reported_there(tmp_path, run_env, handshake):
    base = free_port_block(4)
    program = (f"import memtel_run_target, handshake\nmemtel_run_target.logits(2, 2)\n"
               f"handshake.report_and_wait({str(handshake.directory)!r}, 1)\n")
    process = subprocess.Popen([*memtel_run_command("--targets", f"{TARGET},{UNUSED}", "--port", str(base)), "--",
                                "python", "-c", program], env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        handshake.wait_ready(1, process)
        gauges = unresolved_gauges(scrape(base))
    finally:
        handshake.go()
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert gauges == {TARGET: 0.0, UNUSED: 1.0}
    (warning,) = warnings(stderr)
    assert f"1 of 2 hook targets not resolved at this process's first hooked call in pid {process.pid}" in warning
    assert f"{UNUSED} (its module was never imported)" in warning
    assert "memtel_hook_unresolved_targets shows them" in warning


def test_when_nothing_hooks_the_first_process_warns_after_the_delay_once_and_listens_nowhere(tmp_path, run_env):
    base = free_port_block(4)
    release = tmp_path / "release"  # the program runs until the test has read the warning (at most 30 s)
    program = ("import os, time\n"
               "end = time.monotonic() + 30\n"
               f"while not os.path.exists({str(release)!r}) and time.monotonic() < end:\n"
               "    time.sleep(0.02)\n")
    process = subprocess.Popen([*memtel_run_command("--targets", UNUSED, "--port", str(base),
                                                    "--unresolved-after", "1"), "--", "python", "-c", program],
                               env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        early = []
        while not warnings("".join(early)) and (line := process.stderr.readline()):
            early.append(line)
        running = listeners(range(base, base + 4))  # after the warning, the program still running
    finally:
        release.touch()
        _, rest = process.communicate(timeout=60)
    stderr = "".join(early) + rest
    assert process.returncode == 0, stderr
    assert running == {}
    (warning,) = warnings(stderr)   # after 1 s; not again at exit
    assert ("1 of 1 hook targets not resolved 1 s after memtel run started, with no process of the run hooked yet, "
            f"in pid {process.pid}") in warning
    assert "memtel_hook_unresolved_targets" not in warning   # no exporter: this process never listened
    assert announcements(stderr) == {}
    assert listeners(range(base, base + 4)) == {}


def test_a_serving_engine_waits_for_its_model_and_a_short_program_is_told_at_exit(tmp_path, run_env):
    # The first process imports `sglang` (an engine: its workers check when the model loaded): no warning
    # after the delay, only at exit, since nothing hooked anywhere.
    root = write_sglang_shaped(tmp_path / "sglang-shaped")
    env = {**run_env, "PYTHONPATH": f"{root}:{PROGRAMS}"}
    done = memtel_run(["--targets", UNUSED, "--port", "off", "--unresolved-after", "0.5"],
                      ["python", "-c", "import sglang, time; time.sleep(1.5)"], env)  # lives 1 s past the delay
    assert done.returncode == 0, done.stderr
    (warning,) = warnings(done.stderr)
    assert "not resolved at the exit of the run's first process, with no process of the run hooked yet" in warning
