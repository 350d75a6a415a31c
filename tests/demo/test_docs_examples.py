"""The commands and files the docs show work as shown (docs/lab.md's op file, docs/demo.md's rerun)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from harness.demo.cli import Daemon, ladder_text

ROOT = Path(__file__).resolve().parents[2]


def test_the_op_file_of_docs_lab_md_replays_and_checks(tmp_path):
    text = (ROOT / "docs" / "lab.md").read_text()
    section = text.split("### Op files (`memtel allocsim FILE`)", 1)[1]
    example = re.search(r"```json\n(.*?)```", section, re.S)
    assert example is not None
    path = tmp_path / "ops.json"
    path.write_text(example.group(1))
    checked = subprocess.run([sys.executable, "-m", "telemetry", "allocsim", "--check", str(path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and checked.stdout == "two: 6 ops, all rows agree\n", checked


def test_docs_demo_md_gives_the_commands_the_demo_writes_into_its_ladder(tmp_path):
    run = tmp_path / "RUN"
    header = ladder_text({"model": "lab"}, Daemon(4242, run / "daemon-state", run / "logs" / "daemon.log"), run)
    written = [line[4:] for line in header.splitlines() if line.startswith("#   ")]
    documented = (ROOT / "docs" / "demo.md").read_text().split("To run the same comparison again", 1)[1]
    block = re.search(r"```sh\n(.*?)```", documented, re.S)
    assert block is not None
    expected = [line.replace("PORT", "4242").replace("RUN", str(run)) for line in block.group(1).strip().splitlines()]
    assert written == expected
