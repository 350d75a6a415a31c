"""The one compiled part: the hook's /proc/meminfo fast path (everything else is in pyproject.toml).

`optional=True`: where no C compiler is available the install still succeeds and the hook uses
the pure-Python parser (telemetry.procfs.meminfo), which gives the same answers, slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("telemetry.procfs._meminfo_speedups", ["telemetry/procfs/_meminfo_speedups.c"],
                             extra_compile_args=["-O2"], optional=True)])
