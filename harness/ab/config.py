"""Ladder files: typed dataclasses and their validation.

A ladder file (YAML) says what to compare (arms: servers someone else runs, or commands the harness
serves fresh), where to read telemetry (nodes: the daemon's /metrics; ranks: the hook exporter's
/metrics) and which prompts to send (steps). Validation happens at load, before anything starts:
an unknown key is an error that names it and lists the valid ones, and every error names the file
and the path of the bad field (`ladder.yaml: arms[1].serve.env.FOO: expected a string, got 3`).

`check_reachable` is separate from loading because it talks to the network: the runner calls it
before the first server starts.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from telemetry.errors import ConfigError

API_KINDS = ("completions", "chat")
ARM_ORDERS = ("ABAB", "AABB")
ON_ERROR = ("stop-arm", "continue")


class LadderError(ConfigError):
    """A ladder file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class RequestSettings:
    max_tokens: int = 16
    temperature: float = 0.0
    timeout_s: float = 900.0
    api: str = "completions"  # "completions" (/v1/completions) or "chat" (/v1/chat/completions)
    # False for models that cannot answer (random weights): the needle column then reads "n/a".
    check_answer: bool = True
    # Where the needle sits in the filler, 0 = start, 1 = end.
    needle_depth: float = 0.5
    # Extra JSON fields sent with every request (e.g. {ignore_eos: true} for vLLM).
    extra_body: dict = field(default_factory=dict)
    # Filler vocabulary: a words file or a tokenizer.json (relative to the ladder file). Needed when the
    # model's tokenizer maps English words to one unknown token, or every prompt would be the same.
    words_file: str | None = None


@dataclass(frozen=True)
class ServeSpec:
    command: tuple[str, ...]
    health_url: str
    env: dict = field(default_factory=dict)
    cwd: str | None = None
    startup_timeout_s: float = 600.0
    stop_grace_s: float = 30.0
    log_file: str | None = None  # relative to the run directory; default logs/<arm>-r<repeat>-serve.log
    inherit_env: bool = True


@dataclass(frozen=True)
class Arm:
    name: str
    url: str
    serve: ServeSpec | None = None
    ranks: dict | None = None  # overrides the ladder's ranks for this arm (two servers up at once)
    hook_log_dir: str | None = None  # the hook's JSONL logs of a server the harness does not start
    on_error: str | None = None  # overrides the ladder's on_error for this arm


@dataclass(frozen=True)
class Step:
    """One rung of the ladder: a prompt of `tokens` tokens (the target), built from `seed`."""

    label: str
    tokens: int
    seed: int


# The ladder of the issue: a cold ~100k prefill, another ~100k with different content, then ~200k.
DEFAULT_STEPS = (Step("cold-100k", 100_000, 1), Step("cold-100k-b", 100_000, 2), Step("cold-200k", 200_000, 3))


@dataclass(frozen=True)
class Ladder:
    model: str
    arms: tuple[Arm, ...]
    steps: tuple[Step, ...]
    request: RequestSettings = RequestSettings()
    nodes: dict = field(default_factory=dict)
    ranks: dict = field(default_factory=dict)
    repeats: int = 1
    order: str = "ABAB"
    on_error: str = "stop-arm"
    sample_interval_s: float = 1.0
    source: str = "<dict>"

    def ranks_for(self, arm: Arm) -> dict:
        return dict(arm.ranks) if arm.ranks is not None else dict(self.ranks)

    def on_error_for(self, arm: Arm) -> str:
        return arm.on_error or self.on_error

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("source")
        return _plain(data)

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> Ladder:
        return _Parser(source).ladder(data)


def load_ladder(path: str | Path) -> Ladder:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise LadderError(f"{path}: cannot read the ladder file ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise LadderError(f"{path}: not valid YAML: {exc}") from None
    ladder = Ladder.from_dict(data, source=str(path))
    return _resolve_paths(ladder, path.parent)


def _resolve_paths(ladder: Ladder, base: Path) -> Ladder:
    """Relative serve.cwd and words_file are relative to the ladder file, so profiles work from anywhere."""
    words_file = ladder.request.words_file
    if words_file and not Path(words_file).is_absolute():
        words_file = str((base / words_file).resolve())
        ladder = dataclasses.replace(ladder, request=dataclasses.replace(ladder.request, words_file=words_file))
    if words_file:
        from harness.ab.prompts import PromptError, load_words

        try:
            load_words(words_file)
        except (OSError, ValueError, PromptError) as exc:
            raise LadderError(f"{ladder.source}: request.words_file: {exc}") from None
    arms = []
    for arm in ladder.arms:
        if arm.serve is not None and arm.serve.cwd and not Path(arm.serve.cwd).is_absolute():
            cwd = str((base / arm.serve.cwd).resolve())
            arm = dataclasses.replace(arm, serve=dataclasses.replace(arm.serve, cwd=cwd))
        arms.append(arm)
    return dataclasses.replace(ladder, arms=tuple(arms))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


_MISSING = object()


class _Parser:
    """Walks the YAML data with the path of every field, so each error can name it."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, message: str) -> LadderError:
        where = f"{self.source}: {path}" if path else self.source
        return LadderError(f"{where}: {message}")

    def mapping(self, data: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
        if not isinstance(data, dict):
            raise self.fail(path, f"expected a mapping with keys {', '.join(required + optional)}, got {_kind(data)}")
        valid = required + optional
        for key in data:
            if key not in valid:
                raise self.fail(_join(path, str(key)), f"unknown key {key!r}; valid keys here: {', '.join(valid)}")
        for key in required:
            if key not in data or data[key] is None:
                raise self.fail(_join(path, key), "missing (required)")
        return data

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(path, f"expected a non-empty string, got {_kind(value)}")
        return value

    def integer(self, value: Any, path: str, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected an integer, got {_kind(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(path, f"expected an integer >= {minimum}, got {value}")
        return value

    def number(self, value: Any, path: str, minimum: float | None = None, maximum: float | None = None) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, f"expected a number, got {_kind(value)}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise self.fail(path, f"expected a number in [{minimum}, {maximum}], got {value}")
        return float(value)

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected true or false, got {_kind(value)}")
        return value

    def choice(self, value: Any, path: str, choices: tuple[str, ...]) -> str:
        if value not in choices:
            raise self.fail(path, f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    def url(self, value: Any, path: str) -> str:
        value = self.string(value, path)
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise self.fail(path, f"expected an http(s) URL such as http://127.0.0.1:8000, got {value!r}")
        try:
            _ = parts.port  # raises on a port that is not a number in 0..65535
        except ValueError:
            raise self.fail(path, f"bad port in URL {value!r}") from None
        return value.rstrip("/")

    def url_map(self, value: Any, path: str) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping of name -> /metrics URL, got {_kind(value)}")
        return {self.string(str(name), _join(path, str(name))): self.url(url, _join(path, str(name)))
                for name, url in value.items()}

    def request(self, data: Any, path: str) -> RequestSettings:
        if data is None:
            return RequestSettings()
        fields = tuple(f.name for f in dataclasses.fields(RequestSettings))
        data = self.mapping(data, path, (), fields)
        out: dict[str, Any] = {}
        if "max_tokens" in data:
            out["max_tokens"] = self.integer(data["max_tokens"], _join(path, "max_tokens"), 1)
        if "temperature" in data:
            out["temperature"] = self.number(data["temperature"], _join(path, "temperature"), 0.0, 2.0)
        if "timeout_s" in data:
            out["timeout_s"] = self.number(data["timeout_s"], _join(path, "timeout_s"), 1.0)
        if "api" in data:
            out["api"] = self.choice(data["api"], _join(path, "api"), API_KINDS)
        if "check_answer" in data:
            out["check_answer"] = self.boolean(data["check_answer"], _join(path, "check_answer"))
        if "needle_depth" in data:
            out["needle_depth"] = self.number(data["needle_depth"], _join(path, "needle_depth"), 0.0, 1.0)
        if data.get("words_file") is not None:
            out["words_file"] = self.string(data["words_file"], _join(path, "words_file"))
        if "extra_body" in data:
            if not isinstance(data["extra_body"], dict):
                raise self.fail(_join(path, "extra_body"), f"expected a mapping, got {_kind(data['extra_body'])}")
            out["extra_body"] = dict(data["extra_body"])
        return RequestSettings(**out)

    def serve(self, data: Any, path: str) -> ServeSpec:
        data = self.mapping(data, path, ("command", "health_url"),
                            ("env", "cwd", "startup_timeout_s", "stop_grace_s", "log_file", "inherit_env"))
        command = data["command"]
        if isinstance(command, str) or not isinstance(command, list) or not command:
            raise self.fail(_join(path, "command"),
                            f"expected a non-empty list of strings (argv), got {_kind(command)}")
        argv = tuple(self.string(str(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a,
                                 f"{_join(path, 'command')}[{i}]") for i, a in enumerate(command))
        env: dict[str, str] = {}
        raw_env = data.get("env") or {}
        if not isinstance(raw_env, dict):
            raise self.fail(_join(path, "env"), f"expected a mapping of NAME: value, got {_kind(raw_env)}")
        for name, value in raw_env.items():
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise self.fail(_join(path, f"env.{name}"), f"expected a string (quote it), got {_kind(value)}")
            env[str(name)] = str(value)
        return ServeSpec(
            command=argv,
            health_url=self.url(data["health_url"], _join(path, "health_url")),
            env=env,
            cwd=self.string(data["cwd"], _join(path, "cwd")) if data.get("cwd") is not None else None,
            startup_timeout_s=self.number(data.get("startup_timeout_s", 600.0), _join(path, "startup_timeout_s"), 1.0),
            stop_grace_s=self.number(data.get("stop_grace_s", 30.0), _join(path, "stop_grace_s"), 0.0),
            log_file=(self.string(data["log_file"], _join(path, "log_file")) if data.get("log_file") is not None
                      else None),
            inherit_env=self.boolean(data.get("inherit_env", True), _join(path, "inherit_env")),
        )

    def arm(self, data: Any, path: str) -> Arm:
        data = self.mapping(data, path, ("name",), ("url", "serve", "ranks", "hook_log_dir", "on_error"))
        name = self.string(data["name"], _join(path, "name"))
        if not all(c.isalnum() or c in "-_." for c in name):
            raise self.fail(_join(path, "name"), f"use letters, digits, '-', '_' or '.' (it names files), got {name!r}")
        serve = self.serve(data["serve"], _join(path, "serve")) if data.get("serve") is not None else None
        if data.get("url") is not None:
            url = self.url(data["url"], _join(path, "url"))
        elif serve is not None:
            parts = urlsplit(serve.health_url)
            url = f"{parts.scheme}://{parts.netloc}"  # the server's base URL is the health URL's origin
        else:
            raise self.fail(path, "an arm needs `url` (a server someone else runs) or `serve` (a command to start)")
        ranks = self.url_map(data["ranks"], _join(path, "ranks")) if data.get("ranks") is not None else None
        hook_log_dir = (self.string(data["hook_log_dir"], _join(path, "hook_log_dir")) if data.get("hook_log_dir")
                        else None)
        on_error = self.choice(data["on_error"], _join(path, "on_error"), ON_ERROR) if data.get("on_error") else None
        return Arm(name=name, url=url, serve=serve, ranks=ranks, hook_log_dir=hook_log_dir, on_error=on_error)

    def steps(self, data: Any, path: str) -> tuple[Step, ...]:
        if data is None:
            data = [dataclasses.asdict(s) for s in DEFAULT_STEPS]
        if not isinstance(data, list) or not data:
            raise self.fail(path, f"expected a non-empty list of {{label, tokens, seed}}, got {_kind(data)}")
        steps: list[Step] = []
        for i, item in enumerate(data):
            item_path = f"{path}[{i}]"
            item = self.mapping(item, item_path, ("label", "tokens", "seed"), ())
            step = Step(
                label=self.string(str(item["label"]), _join(item_path, "label")),
                tokens=self.integer(item["tokens"], _join(item_path, "tokens"), 64),
                seed=self.integer(item["seed"], _join(item_path, "seed"), 0),
            )
            for j, other in enumerate(steps):
                if other.label == step.label:
                    raise self.fail(_join(item_path, "label"),
                                    f"{step.label!r} is already used by {path}[{j}]; labels must be unique")
                if other.seed == step.seed:
                    raise self.fail(_join(item_path, "seed"), f"{step.seed} is already used by {path}[{j}]; "
                                    "each step needs its own seed so no prompt repeats and the prefix cache never hits")
            steps.append(step)
        return tuple(steps)

    def ladder(self, data: Any) -> Ladder:
        data = self.mapping(data, "", ("model", "arms"),
                            ("request", "nodes", "ranks", "steps", "repeats", "order", "on_error", "sample_interval_s"))
        arms_data = data["arms"]
        if not isinstance(arms_data, list) or not arms_data:
            raise self.fail("arms", f"expected a non-empty list of arms, got {_kind(arms_data)}")
        arms = tuple(self.arm(a, f"arms[{i}]") for i, a in enumerate(arms_data))
        names = [a.name for a in arms]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise self.fail(f"arms[{i}].name", f"{name!r} is already used by arms[{names.index(name)}]")
        return Ladder(
            model=self.string(data["model"], "model"),
            arms=arms,
            steps=self.steps(data.get("steps"), "steps"),
            request=self.request(data.get("request"), "request"),
            nodes=self.url_map(data.get("nodes"), "nodes"),
            ranks=self.url_map(data.get("ranks"), "ranks"),
            repeats=self.integer(data.get("repeats", 1), "repeats", 1),
            order=self.choice(data.get("order", "ABAB"), "order", ARM_ORDERS),
            on_error=self.choice(data.get("on_error", "stop-arm"), "on_error", ON_ERROR),
            sample_interval_s=self.number(data.get("sample_interval_s", 1.0), "sample_interval_s", 0.05, 60.0),
            source=self.source,
        )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, (dict, list)):
        return type(value).__name__
    return f"{type(value).__name__} {value!r}"


# --- reachability (network; called by the runner before anything starts) ---

def _origin(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def _tcp_open(host: str, port: int, timeout: float) -> str | None:
    """None when something accepts connections at host:port, else the reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def check_reachable(ladder: Ladder, timeout: float = 3.0) -> None:
    """Every URL the run needs now must answer; every port a served arm will bind must be free.

    Rank URLs of served arms are checked once their server is up (the hook exporter lives in it).
    """
    import httpx

    problems: list[str] = []

    def http_ok(url: str, path: str) -> None:
        try:
            httpx.get(url, timeout=timeout)
        except httpx.HTTPError as exc:
            problems.append(f"{path}: {url} is not reachable ({type(exc).__name__}: {exc})")

    for i, arm in enumerate(ladder.arms):
        if arm.serve is None:
            http_ok(arm.url + "/v1/models", f"arms[{i}].url")
        else:
            origins = {_origin(arm.url): "url"}
            origins.setdefault(_origin(arm.serve.health_url), "serve.health_url")
            for (host, port), what in origins.items():
                if _tcp_open(host, port, timeout) is None:
                    problems.append(f"arms[{i}].{what}: {host}:{port} is already in use, but the harness "
                                    "starts this arm's server itself; stop whatever listens there or use `url`")
    for name, url in ladder.nodes.items():
        http_ok(url, f"nodes.{name}")
    if all(arm.serve is None for arm in ladder.arms):
        for name, url in ladder.ranks.items():
            http_ok(url, f"ranks.{name}")
    for i, arm in enumerate(ladder.arms):
        if arm.serve is None and arm.ranks:
            for name, url in arm.ranks.items():
                http_ok(url, f"arms[{i}].ranks.{name}")
    if problems:
        raise LadderError(f"{ladder.source}: " + ("\n  " if len(problems) > 1 else "")
                          + "\n  ".join(dict.fromkeys(problems)))
