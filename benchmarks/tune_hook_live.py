"""A hook's exporter serving a real CUDA allocator state, read by `memtel tune --hook` (CUDA).

    python benchmarks/tune_hook_live.py [--verify] [tune flags after --]

This process builds a mixed allocator state on the GPU (resident tensors, small and large ones, half of them
freed), binds the hook's allocator reader (what a hooked call does) and serves the hook's exporter on
127.0.0.1 (telemetry/hook/exporter.py, `/snapshot`). A fresh `memtel tune --hook` process then fetches the
state and searches; the script prints what torch says of the state beside what tune read (segments, reserved,
allocated), and tune's JSON. With --verify, tune also runs its top setting and today's for real
(`--verify 1 --verify-allocator cuda`) from the fetched state.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    verify = "--verify" in args
    extra = args[args.index("--") + 1:] if "--" in args else []
    import torch
    from prometheus_client import CollectorRegistry

    from telemetry.hook.allocator import current_reader
    from telemetry.hook.exporter import start_exporter

    g = torch.Generator().manual_seed(1)
    kept = [torch.empty(int(n) * MIB, dtype=torch.uint8, device="cuda") for n in (900, 300, 64, 512)]
    mixed = [torch.empty(int(torch.randint(1, 40 * MIB, (1,), generator=g)), dtype=torch.uint8, device="cuda")
             for _ in range(200)]
    kept += mixed[::2]
    del mixed
    torch.cuda.synchronize()
    current_reader().read()   # binds the reader to this device, as the first hooked call does
    server = start_exporter(CollectorRegistry(), "127.0.0.1", 0)
    total = torch.cuda.get_device_properties(0).total_memory
    reserved = torch.cuda.memory_reserved()
    memory_gb = (reserved + 2 * 1024 * MIB) / 1024**3
    command = [sys.executable, "-m", "telemetry", "tune", "--hook", f"127.0.0.1:{server.port}",
               "--target-tokens", "131072", "--memory-gb", f"{memory_gb:.6f}",
               "--total-memory-gb", repr(total / 1024**3), "--layers", "4", "--max-model-len", "262144",
               "--topk", "2048", "--chunks", "8192,16384", "--budgets-mb", "512,1024,2048", "--max-split-mb", "none",
               "--roundup", "none", "--expandable-segments", "False", "--modes", "stock", *extra]
    if verify:
        command += ["--verify", "1", "--verify-allocator", "cuda"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False, timeout=400)
    finally:
        server.stop()
    torch_says = {"segments": len(torch.cuda.memory_snapshot()), "reserved_bytes": reserved,
                  "allocated_bytes": torch.cuda.memory_allocated()}
    print(json.dumps({"torch": torch_says, "tune_exit": done.returncode, "tune_stderr": done.stderr[-2000:]}))
    print(done.stdout)
    del kept
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
