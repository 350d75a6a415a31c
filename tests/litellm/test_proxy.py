"""A real LiteLLM proxy (.venv-litellm, `litellm --config`) with memtel's pre-call hook and routing strategy in
front of two lab nodes of different capacity (1 GiB: ~270k tokens fit; 2 GiB: ~532k), max-model-len 600,000.

One proxy and two nodes per module (starting them takes most of its time: the proxy ~10 s, the nodes ~8 s
each, side by side), so the module is `slow`. The proxy runs configs/litellm/config.yaml as shipped, its two
deployments pointed at the nodes (`model_info.memtel_hooks`: their hooks); LiteLLM's `x-litellm-model-id` header
names the deployment that served.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from harness.demo.guarded import FORECAST_ENV, NODE_ARGS, Process, prompt_text
from harness.ports import free_port_block
from harness.processes import wait_healthy
from telemetry.errors import RunError

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LITELLM = ROOT / ".venv-litellm" / "bin" / "litellm"
SHIPPED = ROOT / "configs" / "litellm" / "config.yaml"
MAX_MODEL_LEN = 600_000
HOLD_S = 12.0  # long enough for a 300k-token prefill ahead to end on a busy 2-core machine
CAPACITIES = {"small": 1.0, "big": 2.0}


def node_command(port: int, hook_port: int, capacity_gb: float) -> list[str]:
    args = list(NODE_ARGS)
    args[args.index("--max-model-len") + 1] = str(MAX_MODEL_LEN)
    return [str(ROOT / ".venv" / "bin" / "python"), "-m", "telemetry", "lab", "serve", *args, "--capacity-gb",
            repr(capacity_gb), "--time-scale", "0.01", "--host", "127.0.0.1", "--port", str(port), "--memtel-port",
            str(hook_port), "--model-name", "lab"]


def forecast_out(url: str) -> bool:
    try:
        return "memtel_forecast_max_prefill_tokens{" in httpx.get(url).text
    except httpx.HTTPError:
        return False


class Stack:
    def __init__(self, tmp: Path) -> None:
        base = free_port_block(5)
        self.proxy_port = base
        self.ports = {"small": (base + 1, base + 2), "big": (base + 3, base + 4)}
        self.tmp = tmp
        self.processes: list[Process] = []
        self.key = f"sk-memtel-test-{secrets.token_hex(16)}"

    def config(self) -> Path:
        """configs/litellm/config.yaml as shipped, its two deployments pointed at the lab nodes."""
        config = yaml.safe_load(SHIPPED.read_text())
        for entry, (name, (port, hook)) in zip(config["model_list"], self.ports.items(), strict=True):
            entry["model_name"] = "lab"
            entry["litellm_params"].update(model="openai/lab", api_base=f"http://127.0.0.1:{port}/v1")
            entry["model_info"].update(id=name, memtel_hooks=[f"http://127.0.0.1:{hook}"])
        path = self.tmp / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self) -> None:
        if not LITELLM.exists():
            pytest.fail(f"{LITELLM} is missing: scripts/test builds it (scripts/lib/setup.sh ensure_litellm_venv)")
        env = {"MEMTEL_LITELLM_HOLD_S": str(HOLD_S), "LITELLM_LOG": "ERROR",
               "DISABLE_ADMIN_UI": "True", "LITELLM_TELEMETRY": "False", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
               "LITELLM_MASTER_KEY": self.key,
               "PYTHONPATH": str(ROOT)}
        proxy = Process([str(LITELLM), "--config", str(self.config()), "--host", "127.0.0.1", "--port",
                         str(self.proxy_port), "--num_workers", "1"], self.tmp / "proxy.log", env)
        self.processes.append(proxy)
        errors: list[BaseException] = []
        # Started from this thread: the children die with the thread that forked them (PR_SET_PDEATHSIG).
        nodes = {name: Process(node_command(port, hook, CAPACITIES[name]), self.tmp / f"{name}.log", FORECAST_ENV)
                 for name, (port, hook) in self.ports.items()}
        self.processes.extend(nodes.values())

        def node(name: str) -> None:
            try:
                wait_healthy(f"http://127.0.0.1:{self.ports[name][0]}/health", nodes[name].process, timeout_s=120,
                             log_path=self.tmp / f"{name}.log", what=f"the {name} lab node", error=RunError,
                             interval_s=0.2)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=node, args=(name,)) for name in self.ports]
        for thread in threads:
            thread.start()
        wait_healthy(f"http://127.0.0.1:{self.proxy_port}/health/liveliness", proxy.process, timeout_s=120,
                     log_path=self.tmp / "proxy.log", what="the LiteLLM proxy", error=RunError, interval_s=0.2)
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        for name, (_, hook) in self.ports.items():  # every node's forecast is out before the first prompt
            deadline = time.monotonic() + 120
            while not forecast_out(f"http://127.0.0.1:{hook}/metrics"):
                assert time.monotonic() < deadline, f"the {name} node exports no forecast"
                time.sleep(0.1)

    def chat(self, words: int, seed: int, client: httpx.Client | None = None) -> httpx.Response:
        body = {"model": "lab", "max_tokens": 4, "messages": [{"role": "user", "content": prompt_text(words, seed)}]}
        return (client or httpx).post(f"http://127.0.0.1:{self.proxy_port}/v1/chat/completions", json=body,
                                      headers={"Authorization": f"Bearer {self.key}"}, timeout=120)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    started = Stack(tmp_path_factory.mktemp("litellm"))
    try:
        started.start()
        yield started
    finally:
        started.stop()


def served_by(response: httpx.Response) -> str | None:
    return response.headers.get("x-litellm-model-id")


def test_a_normal_prompt_is_served(stack: Stack) -> None:
    response = stack.chat(1000, 1)
    assert response.status_code == 200, response.text
    assert served_by(response) in CAPACITIES


def test_a_long_prompt_goes_to_the_big_node(stack: Stack) -> None:
    """300k tokens fit the 2 GiB node (~532k) and not the 1 GiB one (~270k)."""
    response = stack.chat(300_000, 2)
    assert response.status_code == 200, response.text[:500]
    assert served_by(response) == "big"


def test_a_prompt_over_max_model_len_is_refused_at_once(stack: Stack) -> None:
    started = time.perf_counter()
    response = stack.chat(MAX_MODEL_LEN + 50_000, 4)
    assert time.perf_counter() - started < HOLD_S  # not held: no wait can help
    assert response.status_code == 400, response.text[:500]
    assert response.headers.get("x-should-retry") == "false"
    assert "retry-after" not in response.headers
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    fields = error["provider_specific_fields"]
    assert fields["code"] == "context_length_exceeded"
    assert fields["max_model_len"] == MAX_MODEL_LEN
    assert fields["prompt_tokens"] >= MAX_MODEL_LEN


def test_a_prompt_that_fits_nowhere_now_is_held_then_refused(stack: Stack) -> None:
    """Within max-model-len, over both nodes' limits, and nothing frees: held HOLD_S, then 503 Retry-After."""
    started = time.perf_counter()
    response = stack.chat(560_000, 5)
    waited = time.perf_counter() - started
    assert response.status_code == 503, response.text[:500]
    assert waited >= HOLD_S * 0.9
    assert response.headers.get("x-should-retry") == "true"
    assert int(response.headers["retry-after"]) > 0
    fields = response.json()["error"]["provider_specific_fields"]
    assert fields["reason"] == "would_not_fit"
    assert fields["node"] == "vm"


def test_a_prompt_behind_a_running_prefill_waits_then_is_served(stack: Stack) -> None:
    """Two 300k prompts at once: the second fits only the big node, where the first holds 300k of its ~532k
    until it is served; the second waits in the hook (not refused) and is served by the big node after it."""
    results: dict[int, httpx.Response] = {}

    def send(seed: int) -> None:
        results[seed] = stack.chat(300_000, seed)

    first = threading.Thread(target=send, args=(6,))
    first.start()
    time.sleep(0.5)  # the first is admitted (its hold taken) before the second asks
    started = time.perf_counter()
    send(7)
    waited = time.perf_counter() - started
    first.join()
    assert [r.status_code for r in results.values()] == [200, 200], [r.text[:300] for r in results.values()]
    assert {served_by(r) for r in results.values()} == {"big"}
    print(f"the second prompt was answered after {waited:.1f} s")
