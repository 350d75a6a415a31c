"""The core install into a serving environment (issue 14): nothing up- or downgraded, nothing extra.

Found by a new user: the README's `pip install '/path/to/memtel[torch]'` capped torch below 2.14 while
vLLM 0.33 pins `torch==2.14.0` (pip refused or tried to downgrade the serving stack), and it pulled
matplotlib, rich and httpx into vLLM's environment. Here a fresh venv gets a torch of another version
than CI's (2.13.0): a distribution named `torch`, version 2.14.0 (vLLM 0.33's pin), built at test time,
because a second real torch is a multi-GB CUDA download; pip's resolver sees only the installed
distribution's metadata either way. Then memtel's core is installed from a copy of this checkout, not
editable, as the README says, with pip's index (PyPI or its cache) for prometheus_client and the rest.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.network

FAKE_TORCH_VERSION = "2.14.0"


REQUIREMENTS = """
import json, re
from importlib.metadata import requires
core = [r for r in requires("memtel") or [] if "extra ==" not in r]
print(json.dumps(sorted(re.split(r"[<>=!~;\\[ ]", r, maxsplit=1)[0] for r in core)))
"""


def core_requirements(python: Path) -> set[str]:
    """memtel and what its installed metadata requires without an extra (pyproject.toml's `dependencies`)."""
    # Run outside the checkout: its memtel.egg-info (the editable install's) would answer instead.
    out = subprocess.run([str(python), "-c", REQUIREMENTS], capture_output=True, text=True, check=True, timeout=60,
                         cwd=python.parents[2])
    return {"memtel", *(name.lower().replace("_", "-") for name in json.loads(out.stdout))}
VENV_TOOLS = {"pip", "setuptools", "wheel"}
# Never in a serving environment: the harness extra and what it pulls (matplotlib's numpy among them). h11 is not
# here: the guard's HTTP framing is in the core (pure Python, no dependencies of its own).
HARNESS_ONLY = {"matplotlib", "rich", "httpx", "numpy", "pillow", "contourpy", "kiwisolver", "fonttools",
                "cycler", "pyparsing", "httpcore", "anyio", "markdown-it-py", "pygments", "mdurl"}


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_fake_torch_wheel(directory: Path) -> Path:
    """A minimal, valid wheel of a distribution named torch (pure Python, no CUDA)."""
    dist_info = f"torch-{FAKE_TORCH_VERSION}.dist-info"
    files = {
        "torch/__init__.py": f'__version__ = "{FAKE_TORCH_VERSION}"\n'.encode(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {FAKE_TORCH_VERSION}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: memtel-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist_info}/top_level.txt": b"torch\n",
    }
    record = "\n".join([*(_record_line(name, data) for name, data in files.items()), f"{dist_info}/RECORD,,", ""])
    wheel = directory / f"torch-{FAKE_TORCH_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist_info}/RECORD", record)
    return wheel


def copy_checkout(destination: Path) -> Path:
    """What `pip install /path/to/memtel` reads, without build outputs (pip builds in the source tree)."""
    destination.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, destination / name)
    for package in ("telemetry", "harness"):
        shutil.copytree(ROOT / package, destination / package, ignore=ignore)
    return destination


def installed(python: Path) -> dict[str, str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                         check=True, timeout=120)
    return {entry["name"].lower().replace("_", "-"): entry["version"] for entry in json.loads(out.stdout)}


IMPORTS = """
import json, sys
import telemetry.vllm_plugin, telemetry.hook, telemetry.daemon.cli, telemetry.cli
import torch
import telemetry
sys.path.insert(0, sys.argv[1])
handle = telemetry.install(["serving_mod:f"], port=None)
import serving_mod
serving_mod.f(1)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("httpx", "rich", "matplotlib", "numpy", "harness"))
print(json.dumps({"heavy": heavy, "torch": torch.__version__, "calls": handle.state.calls,
                  "file": telemetry.__file__}))
"""


def test_the_core_installs_beside_another_torch_without_touching_it_or_adding_the_harness(tmp_path):
    venv = tmp_path / "serving-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    wheel = build_fake_torch_wheel(tmp_path)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", str(wheel)], check=True, timeout=300)
    before = installed(python)
    assert before["torch"] == FAKE_TORCH_VERSION

    source = copy_checkout(tmp_path / "memtel-src")
    result = subprocess.run([str(python), "-m", "pip", "install", str(source)], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    after = installed(python)
    assert after["torch"] == FAKE_TORCH_VERSION, "the serving environment's torch was changed"
    assert {name: version for name, version in before.items() if after.get(name) != version} == {}
    assert not HARNESS_ONLY & set(after), sorted(HARNESS_ONLY & set(after))
    # Exactly memtel and its requirements (which need nothing more today), besides pip's tools and torch.
    core = core_requirements(python)
    assert {"prometheus-client", "psutil", "nvidia-ml-py", "pyyaml"} <= core and not HARNESS_ONLY & core
    assert set(after) - VENV_TOOLS - {"torch"} == core, sorted(set(after) - VENV_TOOLS - {"torch"} - core)

    # The hook, the plugin, the daemon and the command line import without the harness's packages, and the
    # hook runs beside this torch (which has no CUDA: no allocator fields, nothing raised).
    (tmp_path / "serving_mod.py").write_text("def f(x):\n    return x\n")
    out = subprocess.run([str(python), "-c", IMPORTS, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["file"].startswith(str(venv))   # the installed copy, not this checkout
    assert report == {**report, "heavy": [], "torch": FAKE_TORCH_VERSION, "calls": 1}
    daemon = subprocess.run([str(venv / "bin" / "memtel"), "daemon", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert daemon.returncode == 0 and "--state-dir" in daemon.stdout, daemon.stderr
