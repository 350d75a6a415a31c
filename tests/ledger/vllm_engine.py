"""What a real vLLM worker allocated, from the model's files and vLLM's own metrics: the expected values of the
hook's `memtel_engine_weights_bytes` and `memtel_engine_kv_cache_bytes` (tests/hook/test_vllm_real.py checks
them against a live server)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
VOCAB_PADDING = 64   # vLLM pads the embedding and LM head's vocabulary to a multiple of 64 (VocabParallelEmbedding)


# vLLM's CPU backend moves every linear layer's weight into a packed (oneDNN or sgl-kernel) buffer after loading
# and empties the parameter (vllm/model_executor/layers/utils.py, dispatch_cpu_unquantized_gemm with
# remove_weight=True, called from linear.py); the embedding and the LM head keep theirs (remove_weight=False).
CPU_REPACKED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def safetensors_bytes(model_dir: Path, skip: re.Pattern[str] | None = None) -> int:
    """Bytes of the tensors in the model's safetensors files (but those whose name matches `skip`), from their
    headers."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        for name, entry in header.items():
            if name == "__metadata__" or (skip is not None and skip.search(name)):
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            assert entry["data_offsets"][1] - entry["data_offsets"][0] == count * DTYPE_BYTES[entry["dtype"]]
            total += count * DTYPE_BYTES[entry["dtype"]]
    return total


def expected_weights_bytes(model_dir: Path, *, cpu: bool = True) -> int:
    """What the model's parameters hold once vLLM loaded it: the safetensors' bytes (on the CPU backend without the
    linear layers, repacked out of their parameters), plus the rows vLLM adds to the embedding and the LM head to
    pad the vocabulary."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    heads = 1 if config.get("tie_word_embeddings") else 2
    kept = safetensors_bytes(model_dir, CPU_REPACKED if cpu else None)
    return kept + heads * (padded - vocab) * hidden * 4   # float32 (--dtype float32)


def expected_kv_cache_bytes(model_dir: Path, vllm_metrics: str) -> int:
    """num_gpu_blocks x block_size tokens (vLLM's `vllm:cache_config_info`) x K and V x layers x KV heads x
    head_dim x 4 bytes (float32)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    info = next(line for line in vllm_metrics.splitlines() if line.startswith("vllm:cache_config_info{"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return tokens * 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
