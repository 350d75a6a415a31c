"""Ladder files: typed dataclasses and their validation.

A ladder file (YAML) says what to compare (arms: servers someone else runs, or commands the harness
serves fresh), where to read telemetry (nodes: the daemon's /metrics; ranks: the hook exporter's
/metrics) and which prompts to send (steps). Validation happens at load, before anything starts:
an unknown key is an error that names it and lists the valid ones, and every error names the file
and the path of the bad field (`ladder.yaml: arms[1].serve.env.FOO: expected a string, got 3`).
The checks and the messages' wording are telemetry/validate.py's, shared with the daemon and web configs.

`check_reachable` is separate from loading because it talks to the network: the runner calls it
before the first server starts.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.ab.gates import Gate, parse_gates
from harness.ab.rundir import name_problem, relative_path_problem
from harness.ab.tuned import TunedArm, apply_tuned, read_tuned
from telemetry import limits
from telemetry.errors import ConfigError
from telemetry.url import parse_http_url
from telemetry.validate import (
    LADDER,
    Field,
    Section,
    Validator,
    boolean,
    choice,
    integer,
    join,
    kind,
    number,
    optional,
    text,
)

API_KINDS = ("completions", "chat")
ARM_ORDERS = ("ABAB", "AABB")
ON_ERROR = ("stop-arm", "continue")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
LOG_FILE_PLACEHOLDERS = {"{arm}": "arm", "{repeat}": "0"}
# request.timeout_s is the timeout of a request of up to this many tokens; a longer step's is scaled up
# in proportion (a prefill's time grows at least linearly with its length), unless the step sets its own.
TIMEOUT_REFERENCE_TOKENS = 100_000


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
    tune: TunedArm | None = None  # a `memtel tune --json` setting added to `serve` (harness/ab/tuned.py)


@dataclass(frozen=True)
class Step:
    """One rung of the ladder: a prompt of `tokens` tokens (the target), built from `seed`."""

    label: str
    tokens: int
    seed: int
    timeout_s: float | None = None  # this step's request timeout; None: derived (Ladder.timeout_for)


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
    gates: tuple[Gate, ...] = ()
    source: str = "<dict>"

    def ranks_for(self, arm: Arm) -> dict:
        return dict(arm.ranks) if arm.ranks is not None else dict(self.ranks)

    def timeout_for(self, step: Step) -> float:
        """The step's request timeout: its own, else request.timeout_s scaled by tokens / 100,000 (never less)."""
        if step.timeout_s is not None:
            return step.timeout_s
        return self.request.timeout_s * max(1.0, step.tokens / TIMEOUT_REFERENCE_TOKENS)

    def on_error_for(self, arm: Arm) -> str:
        return arm.on_error or self.on_error

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("source")
        data["gates"] = [gate.to_dict() for gate in self.gates]  # the file's form, so it reads back the same
        for step in data["steps"]:
            if step.get("timeout_s") is None:
                step.pop("timeout_s", None)
        return _plain(data)

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> Ladder:
        return _Parser(source).ladder(data)


def load_ladder(path: str | Path) -> Ladder:
    """The validated ladder of a YAML file: at most 1 MiB, UTF-8, aliases within bounds (telemetry/safeyaml.py)."""
    from telemetry.safeyaml import load_yaml_file

    path = Path(path)
    try:
        data = load_yaml_file(path, "the ladder file", aliases=True)  # the profiles share `serve` with `<<: *serve`
    except LadderError:
        raise
    except ConfigError as exc:
        raise LadderError(str(exc)) from None
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
    for index, arm in enumerate(ladder.arms):
        if arm.serve is not None and arm.serve.cwd and not Path(arm.serve.cwd).is_absolute():
            cwd = str((base / arm.serve.cwd).resolve())
            arm = dataclasses.replace(arm, serve=dataclasses.replace(arm.serve, cwd=cwd))
        if arm.tune is not None and arm.serve is not None:
            arm = _apply_tune(ladder.source, index, arm, base)
        arms.append(arm)
    return dataclasses.replace(ladder, arms=tuple(arms))


def _apply_tune(source: str, index: int, arm: Arm, base: Path) -> Arm:
    """The arm with its tuned setting read from its file and added to `serve` (harness/ab/tuned.py)."""
    assert arm.tune is not None and arm.serve is not None
    path = f"{source}: arms[{index}].tune"
    if arm.tune.applied or arm.tune.flags or arm.tune.label:
        raise LadderError(f"{path}: label, env and flags are recorded by memtel, not written by hand; give file and "
                          "rank")
    file = Path(arm.tune.file) if Path(arm.tune.file).is_absolute() else (base / arm.tune.file).resolve()
    try:
        label, env, flags = read_tuned(file, arm.tune.rank)
        tuned = TunedArm(str(file), arm.tune.rank, label, env, flags)
        serve = apply_tuned(arm.serve, tuned)
    except ConfigError as exc:
        raise LadderError(f"{path}: {exc}") from None
    return dataclasses.replace(arm, serve=serve, tune=tuned)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# request: each key with its check and its default (RequestSettings'); None: the dataclass's own default.
REQUEST = Section({
    "max_tokens": Field(integer(1, limits.MAX_OUTPUT_TOKENS), RequestSettings.max_tokens),
    "temperature": Field(number(0.0, 2.0), RequestSettings.temperature),
    "timeout_s": Field(number(1.0, limits.MAX_TIMEOUT_S), RequestSettings.timeout_s),
    "api": Field(choice(*API_KINDS), RequestSettings.api),
    "check_answer": Field(boolean, RequestSettings.check_answer),
    "needle_depth": Field(number(0.0, 1.0), RequestSettings.needle_depth),
    "extra_body": Field(lambda v, value, path: _extra_body(v, value, path), None),
    "words_file": Field(optional(text()), None, null_is_default=True),
})


class _Parser(Validator):
    """Walks the YAML data with the path of every field, so each error can name it (telemetry/validate.py)."""

    def __init__(self, source: str) -> None:
        super().__init__(source, wording=LADDER, error_type=LadderError)
        self.ladder_source = source

    def url_map(self, value: Any, path: str) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping of name -> /metrics URL, got {kind(value)}")
        if len(value) > limits.MAX_ENDPOINTS:
            raise self.fail(path, f"expected at most {limits.MAX_ENDPOINTS:,} entries, got {len(value):,}")
        return {self.text(str(name), join(path, str(name))): self.url(url, join(path, str(name)))
                for name, url in value.items()}

    def request(self, data: Any, path: str) -> RequestSettings:
        values = REQUEST.read(self, data, path)
        return RequestSettings(**{k: v for k, v in values.items() if v is not None})

    def serve(self, data: Any, path: str) -> ServeSpec:
        data = self.mapping(data, path, ("command", "health_url"),
                            ("env", "cwd", "startup_timeout_s", "stop_grace_s", "log_file", "inherit_env"))
        command = data["command"]
        if isinstance(command, str) or not isinstance(command, list) or not command:
            raise self.fail(join(path, "command"),
                            f"expected a non-empty list of strings (argv), got {kind(command)}")
        if len(command) > limits.MAX_COMMAND_ARGS:
            raise self.fail(join(path, "command"), f"expected at most {limits.MAX_COMMAND_ARGS:,} arguments, "
                                                    f"got {len(command):,}")
        argv = tuple(self.text(_scalar_text(a), f"{join(path, 'command')}[{i}]", limits.MAX_ARG_CHARS)
                     for i, a in enumerate(command))
        env: dict[str, str] = {}
        raw_env = data.get("env") or {}
        if not isinstance(raw_env, dict):
            raise self.fail(join(path, "env"), f"expected a mapping of NAME: value, got {kind(raw_env)}")
        if len(raw_env) > limits.MAX_ENV_VARS:
            raise self.fail(join(path, "env"), f"expected at most {limits.MAX_ENV_VARS:,} variables, "
                                                f"got {len(raw_env):,}")
        for name, value in raw_env.items():
            if not isinstance(name, str) or not ENV_NAME.fullmatch(name) or len(name) > limits.MAX_NAME_CHARS:
                raise self.fail(join(path, "env"), f"{kind(name)} is not an environment variable name; expected "
                                                    "letters, digits and '_', not starting with a digit")
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise self.fail(join(path, f"env.{name}"), f"expected a string (quote it), got {kind(value)}")
            text = _scalar_text(value)
            if "\0" in text or len(text) > limits.MAX_ARG_CHARS:
                raise self.fail(join(path, f"env.{name}"), f"expected at most {limits.MAX_ARG_CHARS:,} characters "
                                                            "and no NUL character")
            env[name] = text
        log_file = (self.text(data["log_file"], join(path, "log_file")) if data.get("log_file") is not None
                    else None)
        if log_file is not None:
            self.log_file(log_file, join(path, "log_file"))
        return ServeSpec(
            command=argv,
            health_url=self.url(data["health_url"], join(path, "health_url")),
            env=env,
            cwd=self.text(data["cwd"], join(path, "cwd")) if data.get("cwd") is not None else None,
            startup_timeout_s=self.number(data.get("startup_timeout_s", 600.0), join(path, "startup_timeout_s"), 1.0,
                                          limits.MAX_TIMEOUT_S),
            stop_grace_s=self.number(data.get("stop_grace_s", 30.0), join(path, "stop_grace_s"), 0.0,
                                     limits.MAX_STOP_GRACE_S),
            log_file=log_file,
            inherit_env=self.boolean(data.get("inherit_env", True), join(path, "inherit_env")),
        )

    def log_file(self, value: str, path: str) -> None:
        """serve.log_file must stay inside the run directory: relative (or under `{run_dir}/`), no '..'."""
        relative = value[len("{run_dir}/"):] if value.startswith("{run_dir}/") else value
        for placeholder, example in LOG_FILE_PLACEHOLDERS.items():
            relative = relative.replace(placeholder, example)
        problem = relative_path_problem(relative)
        if problem is not None:
            raise self.fail(path, f"{problem} (the log is written inside the run directory)")

    def name(self, value: Any, path: str) -> str:
        """An arm name or a step label: it names files in the run directory."""
        name = self.text(value, path)
        problem = name_problem(name)
        if problem is not None:
            raise self.fail(path, problem)
        return name

    def arm(self, data: Any, path: str) -> Arm:
        data = self.mapping(data, path, ("name",), ("url", "serve", "ranks", "hook_log_dir", "on_error", "tune"))
        name = self.name(data["name"], join(path, "name"))
        serve = self.serve(data["serve"], join(path, "serve")) if data.get("serve") is not None else None
        if data.get("url") is not None:
            url = self.url(data["url"], join(path, "url"))
        elif serve is not None:
            # the server's base URL is the health URL's origin (its credentials too: the client sends them)
            url = parse_http_url(serve.health_url).base_with_credentials
        else:
            raise self.fail(path, "an arm needs `url` (a server someone else runs) or `serve` (a command to start)")
        ranks = self.url_map(data["ranks"], join(path, "ranks")) if data.get("ranks") is not None else None
        hook_log_dir = (self.text(data["hook_log_dir"], join(path, "hook_log_dir")) if data.get("hook_log_dir")
                        else None)
        on_error = self.choice(data["on_error"], join(path, "on_error"), ON_ERROR) if data.get("on_error") else None
        tune = self.tune(data["tune"], join(path, "tune"), serve) if data.get("tune") is not None else None
        return Arm(name=name, url=url, serve=serve, ranks=ranks, hook_log_dir=hook_log_dir, on_error=on_error,
                   tune=tune)

    def tune(self, data: Any, path: str, serve: ServeSpec | None) -> TunedArm:
        """`tune: {file, rank}`; a recorded ladder also has what was applied (`label`, `env`, `flags`)."""
        data = self.mapping(data, path, ("file",), ("rank", "label", "env", "flags"))
        if serve is None:
            raise self.fail(path, "a tuned arm needs `serve`: the command its settings are added to")
        env = data.get("env") or {}
        flags = data.get("flags") or []
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise self.fail(join(path, "env"), f"expected a mapping of NAME: string, got {kind(env)}")
        if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
            raise self.fail(join(path, "flags"), f"expected a list of strings, got {kind(flags)}")
        return TunedArm(file=self.text(data["file"], join(path, "file")),
                        rank=self.integer(data.get("rank", 1), join(path, "rank"), 1, 100),
                        label=self.text(data.get("label") or "-", join(path, "label")) if data.get("label") else "",
                        env=dict(env), flags=tuple(flags))

    def steps(self, data: Any, path: str) -> tuple[Step, ...]:
        if data is None:
            data = [dataclasses.asdict(s) for s in DEFAULT_STEPS]
        if not isinstance(data, list) or not data:
            raise self.fail(path, f"expected a non-empty list of {{label, tokens, seed}}, got {kind(data)}")
        if len(data) > limits.MAX_STEPS:
            raise self.fail(path, f"expected at most {limits.MAX_STEPS:,} steps, got {len(data):,}")
        steps: list[Step] = []
        for i, item in enumerate(data):
            item_path = f"{path}[{i}]"
            item = self.mapping(item, item_path, ("label", "tokens", "seed"), ("timeout_s",))
            step = Step(
                label=self.name(_scalar_text(item["label"]), join(item_path, "label")),
                tokens=self.integer(item["tokens"], join(item_path, "tokens"), limits.MIN_STEP_TOKENS,
                                    limits.MAX_PREFILL_TOKENS),
                seed=self.integer(item["seed"], join(item_path, "seed"), 0, limits.MAX_SEED),
                timeout_s=(self.number(item["timeout_s"], join(item_path, "timeout_s"), 1.0, limits.MAX_TIMEOUT_S)
                           if item.get("timeout_s") is not None else None),
            )
            for j, other in enumerate(steps):
                if other.label == step.label:
                    raise self.fail(join(item_path, "label"),
                                    f"{step.label!r} is already used by {path}[{j}]; labels must be unique")
                if other.seed == step.seed:
                    raise self.fail(join(item_path, "seed"), f"{step.seed} is already used by {path}[{j}]; "
                                    "each step needs its own seed so no prompt repeats and the prefix cache never hits")
            steps.append(step)
        return tuple(steps)

    def ladder(self, data: Any) -> Ladder:
        data = self.mapping(data, "", ("model", "arms"),
                            ("request", "nodes", "ranks", "steps", "repeats", "order", "on_error", "sample_interval_s",
                             "gates"))
        arms_data = data["arms"]
        if not isinstance(arms_data, list) or not arms_data:
            raise self.fail("arms", f"expected a non-empty list of arms, got {kind(arms_data)}")
        if len(arms_data) > limits.MAX_ARMS:
            raise self.fail("arms", f"expected at most {limits.MAX_ARMS} arms, got {len(arms_data):,}")
        arms = tuple(self.arm(a, f"arms[{i}]") for i, a in enumerate(arms_data))
        names = [a.name for a in arms]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise self.fail(f"arms[{i}].name", f"{name!r} is already used by arms[{names.index(name)}]")
        steps = self.steps(data.get("steps"), "steps")
        return Ladder(
            model=self.text(data["model"], "model"),
            arms=arms,
            steps=steps,
            request=self.request(data.get("request"), "request"),
            nodes=self.url_map(data.get("nodes"), "nodes"),
            ranks=self.url_map(data.get("ranks"), "ranks"),
            repeats=self.integer(data.get("repeats", 1), "repeats", 1, limits.MAX_REPEATS),
            order=self.choice(data.get("order", "ABAB"), "order", ARM_ORDERS),
            on_error=self.choice(data.get("on_error", "stop-arm"), "on_error", ON_ERROR),
            sample_interval_s=self.number(data.get("sample_interval_s", 1.0), "sample_interval_s", 0.05, 60.0),
            gates=parse_gates(data.get("gates"), "gates", self.fail, names, [s.label for s in steps]),
            source=self.ladder_source,
        )


def _extra_body(v: Validator, value: Any, path: str) -> dict[str, Any]:
    """JSON fields for every request: a mapping of plain JSON values, at most MAX_EXTRA_BODY_BYTES as JSON."""
    if not isinstance(value, dict):
        raise v.fail(path, f"expected a mapping, got {kind(value)}")
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise v.fail(path, f"expected plain JSON values (strings, finite numbers, true/false, null, lists, "
                              f"mappings with string keys): {exc}") from None
    except RecursionError:
        raise v.fail(path, "nested too deeply") from None
    if len(text.encode()) > limits.MAX_EXTRA_BODY_BYTES:
        raise v.fail(path, f"is {len(text.encode()):,} bytes as JSON; expected at most "
                              f"{limits.MAX_EXTRA_BODY_BYTES:,}")
    result: dict[str, Any] = json.loads(text)
    return result


def _scalar_text(value: Any) -> Any:
    """A YAML number written where text is expected (a port in argv, `seed: 1` as a label) as its text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (not isinstance(value, int)
                                                                            or abs(value) < 10**30):
        return str(value)
    return value


# --- reachability (network; called by the runner before anything starts) ---

def _origin(url: str) -> tuple[str, int]:
    endpoint = parse_http_url(url)
    return endpoint.host, endpoint.port


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
