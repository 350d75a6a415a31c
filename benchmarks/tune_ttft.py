"""TTFT of a long prefill under two `memtel tune` settings, on a small random-weight transformer (CUDA).

    python benchmarks/tune_ttft.py [--tokens 131072,262144] [--repeats 3] [--layers 4] [--hidden 2048]

No serving engine runs here (the device machine has torch and CUDA only), so the model is built in torch: per
layer, attention (bf16, 16 heads of 128, a KV cache of the whole prompt, causal across chunks through SDPA)
and an MLP (4x), and the sparse indexer's part as memtel models it: per chunk step and layer, the logits
launches that `plan_prefill` gives for the shape (float32 [rows, width], rows cut by the logits budget, width
the compressed KV length), each one matmul of 128-dim index queries against the compressed index keys, then
top-k 2,048 of it, the previous launch's logits alive while the next is made. The prompt is prefilled chunk by
chunk; the first token is the argmax of the last position's logits over a 32,000-entry vocabulary, read back
on the host: TTFT is from the first chunk's start to that read.

What it is not: no real weights, no tokenizer, no scheduler, no MoE, no multi-head indexer weights or FP8
kernels; the attention is dense (the sparse attention that the indexer's top-k feeds is not modelled). It
shows what the tuned budget and chunk cost or save in launches and kernel sizes on this device, not a served
model's TTFT. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
SETTINGS = {"today": (2048, 8192), "best": (1024, 16384)}   # (logits budget MiB, chunk): BENCHMARKS.md, tune


def build(torch: Any, layers: int, hidden: int, max_tokens: int, ratio: int, dev: str) -> dict[str, Any]:
    bf16 = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*shape: int) -> Any:
        return (torch.randn(*shape, device=dev, dtype=bf16, generator=g) / shape[0] ** 0.5)

    heads = hidden // 128
    return {"layers": [{"qkv": w(hidden, 3 * hidden), "out": w(hidden, hidden), "up": w(hidden, 4 * hidden),
                        "down": w(4 * hidden, hidden), "iq": w(hidden, 128), "ik": w(hidden, 128),
                        "k": torch.empty(1, heads, max_tokens, 128, device=dev, dtype=bf16),
                        "v": torch.empty(1, heads, max_tokens, 128, device=dev, dtype=bf16),
                        "index_keys": torch.empty(max_tokens // ratio + 1, 128, device=dev, dtype=torch.float32)}
                       for _ in range(layers)],
            "embed": w(hidden, hidden), "vocab": w(hidden, 32000), "heads": heads, "device": dev}


def prefill(torch: Any, model: dict[str, Any], shape: Any, tokens: int) -> tuple[int, int]:
    """The whole prompt chunk by chunk, then the first token; returns (token, logits launches)."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention, silu

    from telemetry.model.indexer.planner import plan_prefill

    heads = model["heads"]
    launches = 0
    x = None
    for step, step_launches in plan_prefill(tokens, shape, "stock"):
        start, rows = step.start, step.rows
        end = start + rows
        x = torch.randn(rows, model["embed"].shape[0], device=model["device"], dtype=torch.bfloat16) @ model["embed"]
        kept = None
        for layer in model["layers"]:
            q, k, v = (x @ layer["qkv"]).view(rows, 3, heads, 128).permute(1, 2, 0, 3).unsqueeze(1)
            layer["k"][:, :, start:end] = k
            layer["v"][:, :, start:end] = v
            attn = scaled_dot_product_attention(q, layer["k"][:, :, :end], layer["v"][:, :, :end],
                                                attn_mask=causal_lower_right(rows, end))
            x = x + attn.squeeze(0).transpose(0, 1).reshape(rows, -1) @ layer["out"]
            kv = step.kv_len
            first = start // shape.compress_ratio
            layer["index_keys"][first:kv] = (x[::shape.compress_ratio][: kv - first] @ layer["ik"]).float()
            queries = (x @ layer["iq"]).float()
            row = 0
            for launch in step_launches:
                logits = queries[row:row + launch.rows] @ layer["index_keys"][:launch.width].T
                torch.topk(logits, min(shape.topk, launch.width), dim=1)
                kept = logits   # the previous launch's logits stay alive while the next is made
                row += launch.rows
                launches += 1
            x = x + silu(x @ layer["up"]) @ layer["down"]
        del kept
    assert x is not None
    token = int(torch.argmax(x[-1:] @ model["vocab"]).item())
    return token, launches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="131072,262144")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=1 << 20)
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test)")
    args = parser.parse_args(argv)
    import torch

    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    from telemetry.model.indexer.shape import IndexerShape

    lengths = [int(t) for t in args.tokens.split(",")]
    model = build(torch, args.layers, args.hidden, max(lengths), 4, args.device)
    rows = []
    for tokens in lengths:
        for name, (budget_mb, chunk) in SETTINGS.items():
            shape = IndexerShape(layers=args.layers, chunk=chunk, compress_ratio=4, max_model_len=args.max_model_len,
                                 logits_budget_bytes=budget_mb * MIB, topk=2048)
            prefill(torch, model, dataclasses.replace(shape), min(tokens, 2 * chunk))   # warm-up: kernels, cache
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.repeats):
                sync()
                began = time.perf_counter()
                _, launches = prefill(torch, model, shape, tokens)
                times.append(time.perf_counter() - began)
            rows.append({"tokens": tokens, "setting": name, "budget_mb": budget_mb, "chunk": chunk,
                         "logits_launches": launches, "ttft_s": [round(t, 4) for t in times],
                         "ttft_median_s": round(statistics.median(times), 4),
                         "peak_reserved_mib": torch.cuda.max_memory_reserved() / MIB if cuda else None})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                      "layers": args.layers, "hidden": args.hidden, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
