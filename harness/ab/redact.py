"""Secrets never reach a run's files or console: env values that look secret and URL credentials are redacted.

A ladder's `serve.env` often carries a token (`HF_TOKEN`, `VLLM_API_KEY`), a server command an
`--api-key`, and a URL `user:password@`. The harness needs them to run, not to record them, so every
record (`RecordWriter`), every console line, the serve log's header, the report and error messages
go through one `Redactor`:

- an environment variable is secret when its name contains, in any case, one of `SECRET_NAME_PARTS`
  (token, key, secret, password, passwd, auth, credential): its value is recorded as `***`, however
  short;
- a command-line option is secret when a word of its name (split at `-`, `_`, `.`) is one of
  `SECRET_OPTION_WORDS` or ends in one of them (`--api-key`, `--hf-token`, `--password=...`): its
  value becomes `***`. Whole words, not substrings, so `--max-num-batched-tokens 8192` and
  `--tokenizer PATH` stay readable;
- URL credentials (`scheme://user:password@host`, `scheme://token@host`) become `scheme://***@host`
  anywhere in any text (`redact_credentials` of telemetry/url.py, memtel's one URL parser);
- every secret value above (and those of the harness's own secret-looking environment variables, which
  a served command inherits and may print) of at least `MIN_SECRET_CHARS` characters is replaced by
  `***` wherever it appears in any text (error messages, log tails, the ladder file's text).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from telemetry.errors import ConfigError
from telemetry.url import REDACTED, parse_http_url, redact_credentials

if TYPE_CHECKING:
    from harness.ab.config import Ladder

SECRET_NAME_PARTS = ("token", "key", "secret", "password", "passwd", "auth", "credential")
SECRET_OPTION_WORDS = ("token", "key", "secret", "password", "passwd", "auth", "authorization", "credential",
                       "credentials")
MIN_SECRET_CHARS = 6  # shorter values are redacted where they are named (env, options), not searched for in text

# key: value in YAML (block or flow style), for the ladder file's text
_YAML_PAIR = re.compile(r"""(?m)(?P<head>(?:^|[{,\s])["']?(?P<key>[A-Za-z_][\w.-]*)["']?\s*:[ \t]*)"""
                        r"""(?P<value>"(?:[^"\\\n]|\\.)*"|'[^'\n]*'|[^\s,}\]#][^,}\]#\n]*)""")


def is_secret_name(name: str) -> bool:
    """An environment variable (or mapping key) whose value is a secret: its name contains a secret part."""
    lowered = name.lower()
    return any(part in lowered for part in SECRET_NAME_PARTS)


def is_secret_option(option: str) -> bool:
    """A command-line option (`--api-key`, `--hf-token=...`) whose value is a secret."""
    if not option.startswith("-"):
        return False
    words = re.split(r"[-_.]", option.lstrip("-").split("=", 1)[0].lower())
    return any(word.endswith(secret) for word in words if word for secret in SECRET_OPTION_WORDS)


def url_credentials(url: str) -> str | None:
    """The userinfo of a URL (`user:password`, or a token) as written, or None (telemetry/url.py parses it)."""
    try:
        return parse_http_url(url, "").userinfo or None
    except ConfigError:
        return None


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {name: REDACTED if is_secret_name(name) else value for name, value in env.items()}


def secret_option_values(argv: Sequence[str]) -> list[str]:
    values = []
    for i, arg in enumerate(argv):
        if is_secret_option(arg):
            if "=" in arg:
                values.append(arg.split("=", 1)[1])
            elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                values.append(argv[i + 1])
    return values


def redact_argv(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if is_secret_option(arg):
            if "=" in arg:
                arg = arg.split("=", 1)[0] + "=" + REDACTED
            else:
                hide_next = True
        out.append(redact_credentials(arg))
    return out


class Redactor:
    """Replaces known secret values and URL credentials in text and in JSON-like values."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self.named = {s for s in secrets if s}  # every secret value, however short: hidden where it is named
        # Longest first, so a secret that contains another is replaced whole.
        self.secrets = sorted({s for s in self.named if len(s) >= MIN_SECRET_CHARS}, key=len, reverse=True)

    @classmethod
    def for_ladder(cls, ladder: Ladder, environ: Mapping[str, str] | None = None) -> Redactor:
        """The secrets of a ladder: its serve env's, its commands' secret options', its URLs' credentials,
        and the secret-looking variables of the environment a served command inherits."""
        secrets: list[str] = []
        urls = [*ladder.nodes.values(), *ladder.ranks.values()]
        inherits = False
        for arm in ladder.arms:
            urls.append(arm.url)
            urls.extend((arm.ranks or {}).values())
            if arm.serve is not None:
                urls.append(arm.serve.health_url)
                secrets.extend(v for k, v in arm.serve.env.items() if is_secret_name(k))
                secrets.extend(secret_option_values(arm.serve.command))
                inherits = inherits or arm.serve.inherit_env
        secrets.extend(c for c in (url_credentials(u) for u in urls) if c)
        if inherits:
            environ = os.environ if environ is None else environ
            secrets.extend(v for k, v in environ.items() if is_secret_name(k))
        return cls(secrets)

    def text(self, text: str) -> str:
        text = redact_credentials(text)
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text

    def value(self, value: Any) -> Any:
        """A JSON-like value with every string redacted (mapping keys are kept)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value

    def yaml_text(self, text: str) -> str:
        """A YAML file's text with each secret-named key's secret value hidden (however short), then `text()`."""

        def pair(match: re.Match[str]) -> str:
            value = match.group("value").strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            if not is_secret_name(match.group("key")) or value not in self.named:
                return match.group(0)
            return match.group("head") + REDACTED

        return self.text(_YAML_PAIR.sub(pair, text))

    def ladder(self, ladder: Ladder) -> Ladder:
        """The ladder as it is recorded: secret env values, secret options and URL credentials hidden."""
        arms = []
        for arm in ladder.arms:
            serve = arm.serve
            if serve is not None:
                serve = dataclasses.replace(serve, command=tuple(self.value(redact_argv(serve.command))),
                                            env=redact_env(serve.env), health_url=self.text(serve.health_url))
            arms.append(dataclasses.replace(arm, url=self.text(arm.url), serve=serve,
                                            ranks=None if arm.ranks is None else self.value(arm.ranks)))
        return dataclasses.replace(ladder, arms=tuple(arms), nodes=self.value(ladder.nodes),
                                   ranks=self.value(ladder.ranks))


__all__ = ["MIN_SECRET_CHARS", "SECRET_NAME_PARTS", "SECRET_OPTION_WORDS", "Redactor", "is_secret_name",
           "is_secret_option", "redact_argv", "redact_env", "url_credentials"]
