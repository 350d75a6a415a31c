"""memtel harness: the A/B ladder runner and report, the allocator lab and the demo.

Importing this package never imports torch: CUDA paths import it lazily.
"""
