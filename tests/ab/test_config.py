"""Ladder file validation: every error names the file and the field path; nothing starts on a bad file."""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest
import yaml

from harness.ab.config import DEFAULT_STEPS, Ladder, LadderError, check_reachable, load_ladder
from tests.support.ports import free_port

# The minimal ladder file of the issue, verbatim: its key names are pinned.
ISSUE_EXAMPLE = textwrap.dedent("""
    model: tiny
    request: {max_tokens: 16, timeout_s: 900}
    arms:
      - name: stock
        url: http://127.0.0.1:8001
      - name: fixed
        serve:
          command: ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny", "--port", "8002"]
          env: {VLLM_SPARSE_INDEXER_FIXED_LOGITS_WIDTH: "1"}
          health_url: http://127.0.0.1:8002/health
          startup_timeout_s: 600
        url: http://127.0.0.1:8002
    nodes:
      spark-a: http://127.0.0.1:9101/metrics
    ranks:
      rank0: http://127.0.0.1:9200/metrics
    steps:
      - {label: cold-100k, tokens: 100000, seed: 1}
      - {label: cold-100k-b, tokens: 100000, seed: 2}
      - {label: cold-200k, tokens: 200000, seed: 3}
    repeats: 1
""")


def write(tmp_path: Path, text: str, name: str = "ladder.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def example() -> dict:
    return yaml.safe_load(ISSUE_EXAMPLE)


def error_of(data, source="ladder.yaml") -> str:
    with pytest.raises(LadderError) as info:
        Ladder.from_dict(data, source=source)
    return str(info.value)


def test_issue_example_loads_with_its_values(tmp_path):
    ladder = load_ladder(write(tmp_path, ISSUE_EXAMPLE))
    assert ladder.model == "tiny"
    assert ladder.request.max_tokens == 16 and ladder.request.timeout_s == 900
    assert [a.name for a in ladder.arms] == ["stock", "fixed"]
    assert ladder.arms[0].serve is None and ladder.arms[0].url == "http://127.0.0.1:8001"
    serve = ladder.arms[1].serve
    assert serve is not None and serve.command[0] == "python"
    assert serve.env == {"VLLM_SPARSE_INDEXER_FIXED_LOGITS_WIDTH": "1"}
    assert serve.startup_timeout_s == 600
    assert ladder.nodes == {"spark-a": "http://127.0.0.1:9101/metrics"}
    assert ladder.ranks == {"rank0": "http://127.0.0.1:9200/metrics"}
    assert [(s.label, s.tokens, s.seed) for s in ladder.steps] == [
        ("cold-100k", 100000, 1), ("cold-100k-b", 100000, 2), ("cold-200k", 200000, 3)]
    assert ladder.repeats == 1 and ladder.order == "ABAB"


def test_unknown_top_level_key_is_named_with_the_valid_keys(tmp_path):
    path = write(tmp_path, ISSUE_EXAMPLE + "repeat: 2\n")
    with pytest.raises(LadderError) as info:
        load_ladder(path)
    message = str(info.value)
    assert message.startswith(f"{path}: repeat: unknown key 'repeat'")
    assert "repeats" in message and "steps" in message and "arms" in message


def test_unknown_nested_key_names_its_path():
    data = example()
    data["arms"][1]["serve"]["evn"] = {"A": "1"}
    message = error_of(data)
    assert message.startswith("ladder.yaml: arms[1].serve.evn: unknown key 'evn'")
    assert "env" in message and "health_url" in message


def test_missing_field_names_its_path():
    data = example()
    del data["steps"][2]["tokens"]
    assert error_of(data) == "ladder.yaml: steps[2].tokens: missing (required)"
    data = example()
    del data["arms"][1]["serve"]["health_url"]
    assert error_of(data) == "ladder.yaml: arms[1].serve.health_url: missing (required)"
    data = example()
    del data["model"]
    assert error_of(data) == "ladder.yaml: model: missing (required)"


def test_arm_without_url_or_serve():
    data = example()
    del data["arms"][0]["url"]
    assert "arms[0]: an arm needs `url`" in error_of(data)


def test_wrong_types_and_values_are_named():
    cases = [
        (("request", "max_tokens"), "many", "request.max_tokens: expected an integer, got str 'many'"),
        (("request", "api"), "responses", "request.api: expected one of completions, chat, got 'responses'"),
        (("repeats",), 0, "repeats: expected an integer >= 1, got 0"),
        (("order",), "BABA", "order: expected one of ABAB, AABB, got 'BABA'"),
        (("nodes",), {"spark-a": "spark-a:9101"}, "nodes.spark-a: expected an http(s) URL"),
        (("on_error",), "retry", "on_error: expected one of stop-arm, continue"),
    ]
    for keys, value, expected in cases:
        data = example()
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
        assert expected in error_of(data), keys


def test_serve_command_must_be_a_list_and_env_values_strings():
    data = example()
    data["arms"][1]["serve"]["command"] = "vllm serve /models/tiny"
    assert "arms[1].serve.command: expected a non-empty list" in error_of(data)
    data = example()
    data["arms"][1]["serve"]["env"]["FLAG"] = True
    assert "arms[1].serve.env.FLAG: expected a string (quote it)" in error_of(data)


def test_duplicate_seed_or_label_or_arm_name_is_refused():
    data = example()
    data["steps"][2]["seed"] = 1
    assert "steps[2].seed: 1 is already used by steps[0]" in error_of(data)
    data = example()
    data["steps"][1]["label"] = "cold-100k"
    assert "steps[1].label: 'cold-100k' is already used by steps[0]" in error_of(data)
    data = example()
    data["arms"][1]["name"] = "stock"
    assert "arms[1].name: 'stock' is already used by arms[0]" in error_of(data)


def test_default_steps_are_the_100k_100k_200k_ladder():
    data = example()
    del data["steps"]
    ladder = Ladder.from_dict(data)
    assert ladder.steps == DEFAULT_STEPS
    assert [s.tokens for s in ladder.steps] == [100_000, 100_000, 200_000]


def test_serve_url_defaults_to_the_health_urls_origin_and_cwd_is_relative_to_the_file(tmp_path):
    data = example()
    del data["arms"][1]["url"]
    data["arms"][1]["serve"]["cwd"] = "sub"
    path = write(tmp_path, yaml.safe_dump(data))
    ladder = load_ladder(path)
    assert ladder.arms[1].url == "http://127.0.0.1:8002"
    serve = ladder.arms[1].serve
    assert serve is not None and serve.cwd == str((tmp_path / "sub").resolve())
    # the origin as telemetry/url.py parses it, credentials kept for the client that sends them (never shown)
    data["arms"][1]["serve"]["health_url"] = "http://probe:Pw%40x@[::1]:8002/health"
    assert Ladder.from_dict(data).arms[1].url == "http://probe:Pw%40x@[::1]:8002"


def test_yaml_syntax_error_and_missing_file_name_the_file(tmp_path):
    path = write(tmp_path, "model: [unclosed\n")
    with pytest.raises(LadderError, match=rf"^{path}: not valid YAML"):
        load_ladder(path)
    with pytest.raises(LadderError, match="cannot read the ladder file"):
        load_ladder(tmp_path / "absent.yaml")


def test_every_shipped_profile_loads():
    root = Path(__file__).resolve().parents[2] / "configs" / "ladders"
    profiles = sorted(root.glob("*.yaml"))
    assert {p.name for p in profiles} >= {"ab-tp2-two-nodes.yaml", "production.yaml", "cpu-vllm-small.yaml",
                                          "default-100k-100k-200k.yaml"}
    for path in profiles:
        # from_dict: the CPU profiles name a model made on demand (/tmp/memtel-tiny-llama), not shipped.
        ladder = Ladder.from_dict(yaml.safe_load(path.read_text()), source=str(path))
        assert len(ladder.arms) == 2, path
        envs = [arm.serve.env if arm.serve else None for arm in ladder.arms]
        assert envs[0] != envs[1]  # the arms differ by the fixed width


def test_words_file_is_checked_at_load_and_relative_to_the_file(tmp_path):
    data = example()
    data["request"]["words_file"] = "words.txt"
    path = write(tmp_path, yaml.safe_dump(data))
    with pytest.raises(LadderError, match=rf"^{path}: request.words_file: .*words.txt"):
        load_ladder(path)
    (tmp_path / "words.txt").write_text("only three words")
    with pytest.raises(LadderError, match="only 3 usable words"):
        load_ladder(path)
    (tmp_path / "words.txt").write_text(" ".join(f"w{chr(97 + i % 26)}{chr(97 + i // 26)}" for i in range(100)))
    assert load_ladder(path).request.words_file == str(tmp_path / "words.txt")


def test_check_reachable_names_the_unreachable_field():
    dead = free_port()
    ladder = Ladder.from_dict({
        "model": "m", "arms": [{"name": "a", "url": f"http://127.0.0.1:{dead}"}],
        "nodes": {"spark-a": f"http://127.0.0.1:{dead}/metrics"}, "steps": [{"label": "s", "tokens": 100, "seed": 1}],
    }, source="l.yaml")
    with pytest.raises(LadderError) as info:
        check_reachable(ladder, timeout=1.0)
    message = str(info.value)
    assert message.startswith("l.yaml: ")
    assert f"arms[0].url: http://127.0.0.1:{dead}/v1/models is not reachable" in message
    assert f"nodes.spark-a: http://127.0.0.1:{dead}/metrics is not reachable" in message


def test_check_reachable_refuses_a_served_arm_whose_port_is_taken():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ladder = Ladder.from_dict({
            "model": "m", "steps": [{"label": "s", "tokens": 100, "seed": 1}],
            "arms": [{"name": "a", "serve": {"command": ["true"], "health_url": f"http://127.0.0.1:{port}/health"}}],
        }, source="l.yaml")
        with pytest.raises(LadderError, match=rf"arms\[0\].url: 127.0.0.1:{port} is already in use"):
            check_reachable(ladder, timeout=1.0)
