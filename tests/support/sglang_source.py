"""SGLang's source, read from its wheel (never installed, never imported): what the SGLang presets are checked on.

The wheels come from pip's index (`pip download --no-deps`, for Python 3.11 on x86_64 whatever the test's
own platform: the source is the same in every wheel of a version) into a cache directory that is reused:
MEMTEL_TEST_CACHE, else ~/.cache/memtel-tests. SGLang pins the DeepGEMM it calls (sgl-deep-gemm); its
wheel is fetched the same way. A wheel that cannot be fetched or read fails the test (marker `network`).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"              # the version the presets were checked against (docs/hook.md, presets.py)
DEEP_GEMM_VERSION = "0.2.3.post2"      # sgl-deep-gemm, as sglang 0.5.23 pins it
WHEELS = {
    "sglang": (f"sglang=={SGLANG_VERSION}", ["--implementation", "cp", "--abi", "cp311",
                                              "--platform", "manylinux_2_34_x86_64"]),
    "sgl-deep-gemm": (f"sgl-deep-gemm=={DEEP_GEMM_VERSION}", ["--platform", "manylinux2014_x86_64"]),
}


def cache_dir() -> Path:
    return Path(os.environ.get("MEMTEL_TEST_CACHE") or Path.home() / ".cache" / "memtel-tests") / "wheels"


@cache
def wheel(distribution: str) -> Path:
    requirement, platform = WHEELS[distribution]
    name, version = requirement.split("==")
    directory = cache_dir()
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(directory.glob(pattern))
    if not found:
        directory.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               "--python-version", "3.11", *platform, "-d", str(directory), requirement],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        found = sorted(directory.glob(pattern))
        if not found:
            pytest.fail(f"cannot get the {requirement} wheel from pip's index (pip download exited {done.returncode}: "
                        f"{done.stderr.strip()[-500:]}): the SGLang presets are checked against its source")
    return found[-1]


@cache
def _archive(distribution: str) -> zipfile.ZipFile:
    return zipfile.ZipFile(wheel(distribution))


def distribution_of(module: str) -> str:
    return "sgl-deep-gemm" if module.split(".")[0] == "deep_gemm" else "sglang"


def source(module: str) -> str:
    """The source text of `module` from its wheel; fails the test when the wheel has no such module."""
    distribution = distribution_of(module)
    names = set(_archive(distribution).namelist())
    base = "/".join(module.split("."))
    for member in (f"{base}.py", f"{base}/__init__.py"):
        if member in names:
            return _archive(distribution).read(member).decode()
    pytest.fail(f"module {module} is not in {wheel(distribution).name}: the preset names a module this version "
                "does not have")


@cache
def tree(module: str) -> ast.Module:
    return ast.parse(source(module))


def metadata(distribution: str) -> str:
    archive = _archive(distribution)
    (member,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    return archive.read(member).decode()
