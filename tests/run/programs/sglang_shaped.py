"""A program shaped like an SGLang scheduler, for the parts of SGLang that cannot run here (it needs CUDA).

It loads a model through `sglang.srt.model_executor.model_runner.ModelRunner.load_model` (the preset's
model-loaded signal; the runner keeps the model in `self.model`, as SGLang 0.5.23 does) and runs prefill
chunks through the DSA indexer's pattern: `resolve_fp8_mqa_logits_fn()(...)` per row chunk, the resolver
cached with lru_cache and reading `deep_gemm.fp8_mqa_logits` after a function-local `import deep_gemm`.
The modules are written by the test (tests/run/test_unresolved.py) under the real module names; the real
source's shape is checked by tests/hook/test_presets_sglang.py. Usage: sglang_shaped.py HANDSHAKE_DIR
WITH_INDEXER(0/1) CHUNKS.
"""

import sys

import handshake
from sglang.srt.model_executor.model_runner import ModelRunner

if __name__ == "__main__":
    directory, with_indexer, chunks = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    runner = ModelRunner(with_indexer)
    calls = 0
    indexers = [m for m in runner.model.modules() if type(m).__name__ == "Indexer"]
    for chunk in range(chunks):
        for indexer in indexers:
            calls += indexer.prefill(rows=4, context=(chunk + 1) * 4)
    handshake.report_and_wait(directory, calls)
