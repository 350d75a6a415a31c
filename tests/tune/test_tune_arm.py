"""A tuned setting as an arm of a ladder (`tune:`): read from `memtel tune --json`'s output, added to `serve`,
checked, and recorded so the ladder reads back the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.ab.config import Ladder, LadderError, load_ladder
from telemetry.cli import main

from .test_tune import BASE

LADDER = """
model: m
arms:
  - name: today
    serve: {command: [vllm, serve, m], health_url: "http://127.0.0.1:8001/health"}
  - name: tuned
    serve:
      command: [vllm, serve, m]
      health_url: "http://127.0.0.1:8002/health"
      env: {HF_HOME: /tmp/hf}
    tune: {file: tuned.json, rank: RANK}
"""


@pytest.fixture(scope="module")
def tuned_json(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tune") / "tuned.json"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["tune", *BASE, "--json"]) == 0
    path.write_text(out.getvalue())
    return path


def ladder_file(tmp_path: Path, tuned_json: Path, rank: str = "1", text: str = LADDER) -> Path:
    (tmp_path / "tuned.json").write_text(tuned_json.read_text())
    path = tmp_path / "ladder.yaml"
    path.write_text(text.replace("RANK", rank))
    return path


def test_tuned_arm_gets_the_settings_env_and_flags(tmp_path: Path, tuned_json: Path) -> None:
    best = json.loads(tuned_json.read_text())["ranked"][0]
    ladder = load_ladder(ladder_file(tmp_path, tuned_json))
    arm = ladder.arms[1]
    assert arm.tune is not None and arm.tune.applied
    assert arm.serve is not None
    assert arm.serve.env["HF_HOME"] == "/tmp/hf"
    assert arm.serve.env["PYTORCH_CUDA_ALLOC_CONF"] == best["setting"]["alloc_conf"]
    assert arm.serve.env["PYTORCH_ALLOC_CONF"] == best["setting"]["alloc_conf"]   # an inherited one cannot win
    assert arm.serve.env["VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"] == "64"
    assert arm.serve.command[-2:] == ("--max-num-batched-tokens", str(best["setting"]["chunk"]))
    assert ladder.arms[0].tune is None and "PYTORCH_CUDA_ALLOC_CONF" not in ladder.arms[0].serve.env
    # recorded and read back: the same ladder, without reading the file again
    (tmp_path / "tuned.json").unlink()
    again = Ladder.from_dict(json.loads(json.dumps(ladder.to_dict())), source="the recorded ladder")
    assert again.arms == ladder.arms


@pytest.mark.parametrize(("rank", "edit", "words"), [
    ("9", None, "rank 9: "),
    ("1", ("HF_HOME: /tmp/hf", "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB: '512'"),
     "serve.env.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB is '512' and the tuned setting sets '64'"),
    ("1", ("command: [vllm, serve, m]\n      health_url: \"http://127.0.0.1:8002/health\"",
           "command: [vllm, serve, m, --max-num-batched-tokens, '2048']\n      health_url: "
           "\"http://127.0.0.1:8002/health\""), "serve.command already has --max-num-batched-tokens"),
    ("1", ("file: tuned.json", "file: missing.json"), "missing.json does not exist"),
    ("1", ("file: tuned.json", "file: tuned.json, flags: [--x]"), "recorded by memtel, not written by hand"),
])
def test_tuned_arm_refuses_conflicts_and_bad_files(tmp_path: Path, tuned_json: Path, rank: str,
                                                   edit: tuple[str, str] | None, words: str) -> None:
    text = LADDER if edit is None else LADDER.replace(*edit)
    with pytest.raises(LadderError, match=r"arms\[1\]\.tune: ") as error:
        load_ladder(ladder_file(tmp_path, tuned_json, rank, text))
    assert words in str(error.value)


def test_tuned_setting_torch_would_reject_never_reaches_a_server(tmp_path: Path, tuned_json: Path) -> None:
    doc = json.loads(tuned_json.read_text())
    for key in ("setting", "apply"):
        target = doc["ranked"][0][key] if key == "setting" else doc["ranked"][0][key]["env"]
        target["alloc_conf" if key == "setting" else "PYTORCH_CUDA_ALLOC_CONF"] = "roundup_power2_divisions:3"
    path = ladder_file(tmp_path, tuned_json)
    (tmp_path / "tuned.json").write_text(json.dumps(doc))
    with pytest.raises(LadderError, match="power of 2"):
        load_ladder(path)


def test_tuned_arm_needs_serve(tmp_path: Path) -> None:
    path = tmp_path / "ladder.yaml"
    path.write_text("model: m\narms:\n  - {name: a, url: 'http://127.0.0.1:8001', tune: {file: t.json}}\n")
    with pytest.raises(LadderError, match=r"arms\[0\].tune: a tuned arm needs `serve`"):
        load_ladder(path)
