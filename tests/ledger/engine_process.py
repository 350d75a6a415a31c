"""A hooked process with an engine-like worker (torch CPU tensors): the hook's engine signals, as in vLLM.

`python -m tests.ledger.engine_process PORT ADDR`: installs the hook (exporter on ADDR:PORT) with this module's
`Worker.load_model` as the model-loaded signal and `Worker.initialize_from_config` as the engine-memory signal,
loads a small model (its parameters are the weights), allocates a KV cache of which two layers share one tensor
(as vLLM's shared-KV layers do), prints one JSON line with the bytes it made, then waits for stdin to close.
"""

from __future__ import annotations

import json
import sys

import torch

import telemetry
from telemetry.hook.config import HookConfig

MODULE = "tests.ledger.engine_process"


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 64)            # 1000*64*4 bytes
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
        self.register_buffer("inv_freq", torch.ones(32))     # a buffer: not a weight


class Runner:
    def __init__(self) -> None:
        self.model: Model | None = None
        self.kv_caches: list[torch.Tensor] = []


class Worker:
    def __init__(self) -> None:
        self.model_runner = Runner()

    def get_model(self) -> Model | None:
        return self.model_runner.model

    def load_model(self) -> None:
        self.model_runner.model = Model()

    def initialize_from_config(self, blocks: int) -> None:
        layer0 = torch.zeros(2, blocks, 16, 4, 8)            # [k|v, blocks, block size, heads, head dim]
        layer1 = torch.zeros(2, blocks, 16, 4, 8)
        self.model_runner.kv_caches = [layer0, layer1, layer1]   # the third layer shares the second's


def expected(worker: Worker, blocks: int) -> dict[str, int]:
    model = worker.get_model()
    assert model is not None
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"weights_bytes": weights, "kv_cache_bytes": 2 * (2 * blocks * 16 * 4 * 8 * 4)}


def main() -> None:
    port, addr = int(sys.argv[1]), sys.argv[2]
    blocks = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    config = HookConfig(targets=(f"{MODULE}:unused_target",), port=port, addr=addr, unresolved_after_s=None,
                        model_loaded=(f"{MODULE}:Worker.load_model",),
                        engine_memory=(f"{MODULE}:Worker.initialize_from_config",))
    telemetry.hook.install_config(config)
    worker = Worker()
    worker.load_model()
    worker.initialize_from_config(blocks)
    print(json.dumps(expected(worker, blocks)), flush=True)
    sys.stdin.read()


def unused_target() -> None:
    """The hook's target (never called: the ledger needs no hooked call)."""


if __name__ == "__main__":   # run the imported module's code: the hook patches tests.ledger.engine_process
    from tests.ledger import engine_process

    engine_process.main()
