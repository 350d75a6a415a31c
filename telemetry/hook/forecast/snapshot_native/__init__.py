"""The allocator snapshot without the GIL: a small C++ extension for the live forecast's thread.

torch's `torch.cuda.memory_snapshot()` builds a Python dict per segment and block while holding the GIL, which
the serving thread then waits for (BENCHMARKS.md, "Longest prefill that fits"). snapshot_native.cpp takes the same
C++ snapshot with the GIL released and writes it as bytes (codec.py: the format and its decoder, pure Python);
build.py compiles it once per torch into the user's cache; reader.py finds or builds it in the background and
says when it is off (the thread then takes torch's snapshot, as before). The same extension logs the
allocator's trace events (events.py: their bytes) for the event shadow (../shadow.py). docs/hook.md, "Live
forecast".
"""
