"""What machine a benchmark ran on, in the words BENCHMARKS.md uses."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("AMD EPYC ..."), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> str:
    """"2 cores (AMD EPYC ...), 24 GiB, Linux 6.18, Python 3.11.7"."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({cpu_model()}), {mem_gib:.0f} GiB, Linux {platform.release()}, "
            f"Python {platform.python_version()}")
