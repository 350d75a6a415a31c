"""The engines behind the guard, as the user names them: `--upstream` with `--hooks` (one), `--replica` (repeatable)
or a `--replicas` YAML file (several). Each becomes (its upstream, its hooks); bad input is one ConfigError line.

    --replica http://10.0.0.1:8000=http://10.0.0.1:9200,http://10.0.0.2:9200

    # replicas.yaml
    replicas:
      - upstream: http://10.0.0.1:8000
        hooks: [http://10.0.0.1:9200, http://10.0.0.2:9200]
      - upstream: http://10.0.0.3:8000
        hooks: [http://10.0.0.3:9200]
"""

from __future__ import annotations

import os
from typing import Any

from telemetry.errors import ConfigError
from telemetry.safeyaml import load_yaml_file
from telemetry.url import Endpoint, parse_base_url, parse_url

MAX_HOOKS = 64  # per replica
MAX_REPLICAS = 16
REPLICA_EXPECTED = "expected URL=HOOK[,HOOK...], e.g. http://10.0.0.1:8000=http://10.0.0.1:9200"
YAML_EXPECTED = "expected `replicas:`, a list of {upstream: URL, hooks: [URL, ...]}"

Spec = tuple[Endpoint, list[Endpoint]]  # (the engine's base URL, its ranks' hook exporters)


def engine_url(text: str, where: str) -> Endpoint:
    """An engine's base URL. The OpenAI SDKs' base URL of the same engine (`http://h:p/v1`) is taken too: the guard
    adds the `/v1/...` paths itself."""
    trimmed = text.strip().rstrip("/")
    rest = trimmed.split("://", 1)[-1]
    host, slash, last = rest.rpartition("/")
    if slash and host and "/" not in host and last.lower() == "v1":
        return parse_base_url(trimmed[:-len(last) - 1], where)
    return parse_base_url(text, where)


def hook_targets(text: str, flag: str = "--hooks") -> list[Endpoint]:
    """The hook URLs of one engine, comma-separated; at least one, none twice."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ConfigError(f"{flag}: {text[:80]!r}: expected one or more hook URLs separated by commas")
    if len(items) > MAX_HOOKS:
        raise ConfigError(f"{flag}: {len(items)} URLs; at most {MAX_HOOKS}")
    return _distinct([parse_url(item, flag) for item in items], flag)


def _distinct(targets: list[Endpoint], flag: str) -> list[Endpoint]:
    if len({t.url for t in targets}) != len(targets):
        raise ConfigError(f"{flag}: a hook URL is given twice")
    return targets


def replica_flag(text: str) -> Spec:
    """One `--replica URL=HOOK[,HOOK...]`."""
    upstream, sep, hooks = text.partition("=")
    if not sep or not upstream.strip() or not hooks.strip():
        raise ConfigError(f"--replica: {text[:80]!r}: {REPLICA_EXPECTED}")
    return engine_url(upstream, "--replica"), hook_targets(hooks, "--replica")


def replicas_file(path: str | os.PathLike[str]) -> list[Spec]:
    """The replicas of a `--replicas` YAML file (safeyaml: bounded, no aliases)."""
    where = f"--replicas {path}"
    document = load_yaml_file(path, "--replicas file")
    if not isinstance(document, dict) or set(document) != {"replicas"}:
        raise ConfigError(f"{where}: {YAML_EXPECTED}")
    items = document["replicas"]
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{where}: `replicas` is {_kind(items)}; {YAML_EXPECTED}")
    specs = []
    for n, item in enumerate(items, 1):
        at = f"{where}: replica {n}"
        if not isinstance(item, dict) or set(item) != {"upstream", "hooks"}:
            keys = ", ".join(sorted(map(str, item))) if isinstance(item, dict) else _kind(item)
            raise ConfigError(f"{at} has {keys or 'nothing'}; expected exactly the keys upstream and hooks")
        upstream, hooks = item["upstream"], item["hooks"]
        if not isinstance(upstream, str):
            raise ConfigError(f"{at}: upstream is {_kind(upstream)}; expected the engine's base URL")
        if not isinstance(hooks, list) or not hooks or not all(isinstance(h, str) for h in hooks) \
                or len(hooks) > MAX_HOOKS:
            raise ConfigError(f"{at}: hooks must be a list of 1 to {MAX_HOOKS} hook URLs")
        specs.append((engine_url(upstream, at), _distinct([parse_url(h, at) for h in hooks], at)))
    return specs


def _kind(value: Any) -> str:
    return "empty" if value is None else f"a {type(value).__name__}"


def engines(upstream: str | None, hooks: str | None, replica: list[str] | None,
            replicas: str | None) -> list[Spec]:
    """The engines the flags name: exactly one of the three forms; ConfigError otherwise."""
    several = bool(replica) or replicas is not None
    if several and (upstream is not None or hooks is not None):
        raise ConfigError("--upstream/--hooks name one engine, --replica/--replicas several: give one form, not both")
    if replica and replicas is not None:
        raise ConfigError("--replica and --replicas: give the replicas one way, flags or a file")
    if not several:
        if upstream is None:
            raise ConfigError("--upstream URL with --hooks URL[,URL...] (one engine), or --replica / --replicas "
                              "(several): none given")
        if hooks is None:
            raise ConfigError("--hooks: required with --upstream (the engine's ranks' hook exporters)")
        return [(engine_url(upstream, "--upstream"), hook_targets(hooks))]
    specs = [replica_flag(text) for text in replica] if replica else replicas_file(replicas or "")
    if len(specs) > MAX_REPLICAS:
        raise ConfigError(f"--replica: {len(specs)} replicas; at most {MAX_REPLICAS}")
    if len({u.url for u, _h in specs}) != len(specs):
        raise ConfigError("--replica: an upstream is given twice")
    return specs


__all__ = ["MAX_HOOKS", "MAX_REPLICAS", "Spec", "engine_url", "engines", "hook_targets", "replica_flag",
           "replicas_file"]
