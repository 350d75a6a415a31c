"""`git bisect run memtel ab run ...` finds the commit that brought a memory regression.

A temporary git repository holds a tiny scripted history: a ladder whose one arm is a lab server, and a gate
on its reserved growth per request. Commit 4 of 7 flips the lab server's `--arm fixed` to `--arm stock` (the
regression: stock's logits grow with every chunk). `memtel ab run` exits 0 when the gate passes and 3 when it
fails, which is what `git bisect run` needs (0 good, 1-127 but 125 bad).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.ab.lab import ROOT, lab_arm

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "memtel test", "GIT_AUTHOR_EMAIL": "test@example.invalid",
           "GIT_COMMITTER_NAME": "memtel test", "GIT_COMMITTER_EMAIL": "test@example.invalid",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    result = subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"git {' '.join(args)}: {result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow
def test_git_bisect_run_finds_the_commit_that_switched_the_arm(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    # Per request (exact on the simulator): fixed grows 104 MiB once; stock 102 then 292 MiB.
    arm = lab_arm("server", "fixed", chunk=8192, layers=4, max_model_len=204800, budget_mb="512", scale="0.1")
    ladder = {"model": "lab", "request": {"max_tokens": 2, "check_answer": False}, "arms": [arm],
              "steps": [{"label": "cold-32k", "tokens": 32000, "seed": 1},
                        {"label": "cold-64k", "tokens": 64000, "seed": 2}],
              "gates": [{"max_reserved_growth_mib": 200}]}
    commits = []
    for n in range(1, 8):
        if n == 4:
            command = ladder["arms"][0]["serve"]["command"]
            command[command.index("--arm") + 1] = "stock"  # the regression
        (repo / "ladder.yaml").write_text(yaml.safe_dump(ladder, sort_keys=False))
        (repo / "NOTES").write_text(f"change {n}\n")
        git(repo, "add", "ladder.yaml", "NOTES")
        git(repo, "commit", "-q", "-m", f"change {n}")
        commits.append(git(repo, "rev-parse", "HEAD").strip())
    out = tmp_path / "runs" / "bisect"
    script = tmp_path / "check.sh"  # what a user writes: run the ladder of the checked-out commit
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -m telemetry ab run ladder.yaml --out {out} --overwrite "
                      "--no-report\n")
    script.chmod(0o755)
    git(repo, "bisect", "start", commits[-1], commits[0])
    bisect = subprocess.run(["git", "-C", str(repo), "bisect", "run", str(script)], capture_output=True, text=True,
                            timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT), "GIT_CONFIG_GLOBAL": os.devnull,
                                              "GIT_CONFIG_NOSYSTEM": "1"})
    assert bisect.returncode == 0, bisect.stdout[-4000:] + bisect.stderr[-4000:]
    found = re.search(r"^([0-9a-f]{40}) is the first bad commit", bisect.stdout, re.MULTILINE)
    assert found is not None, bisect.stdout[-4000:]
    assert found[1] == commits[3]
    # Each run said why: good commits passed the gate, bad ones failed it (exit 3), none failed otherwise.
    assert "Verdict: PASS — 1 of 1 gates pass; 2 of 2 requests ok" in bisect.stdout
    assert "Verdict: GATE FAILED — 1 of 1 gates failed: max_reserved_growth_mib 200: +292.0 MiB at server repeat 0 " \
        "cold-64k, rank rank0" in bisect.stdout
    assert "REQUESTS FAILED" not in bisect.stdout and "NOTHING RAN" not in bisect.stdout
    git(repo, "bisect", "reset")
