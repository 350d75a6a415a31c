"""A tuned setting as an arm of a ladder: `tune: {file: tuned.json, rank: 1}` beside the arm's `serve`.

`file` is what `memtel tune --json` printed (docs/lab.md, "Tune"); `rank` picks a setting of its ranking (1: the
best). Loading the ladder reads the file, checks the setting (its allocator settings parse under torch's rules;
the environment names and flags are well formed) and adds its environment (`PYTORCH_CUDA_ALLOC_CONF` and
`PYTORCH_ALLOC_CONF`, the logits budget, the width switch) and its engine flags (the chunk, the memory share) to
the arm's `serve`; a variable `serve.env` already sets to another value, or a flag the command already has, is an
error rather than a silent override. The arm then records what was applied (`label`, `env`, `flags`), so the
recorded ladder reads back without the file.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from telemetry import limits
from telemetry.errors import ConfigError

MAX_TUNE_FILE_BYTES = 4 * 1024 * 1024   # `memtel tune --json` writes a few KiB
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")   # torch reads the second first


@dataclass(frozen=True)
class TunedArm:
    """file: the `memtel tune --json` output; rank: which of its settings (1 = best); label, env, flags: what was
    applied to the arm's serve (empty until the ladder file is loaded)."""

    file: str
    rank: int = 1
    label: str = ""
    env: dict = field(default_factory=dict)
    flags: tuple[str, ...] = ()

    @property
    def applied(self) -> bool:
        return bool(self.env)


def _fail(message: str) -> ConfigError:
    return ConfigError(message)


def read_tuned(path: Path, rank: int) -> tuple[str, dict[str, str], tuple[str, ...]]:
    """(label, env, flags) of the setting of rank `rank` in a `memtel tune --json` file; ConfigError says why not."""
    from telemetry.model.allocsim.config import parse_alloc_conf
    from telemetry.model.indexer.shape import MIB
    from telemetry.safefs import read_capped

    try:
        data = json.loads(read_capped(path, MAX_TUNE_FILE_BYTES, follow_symlinks=True))
    except FileNotFoundError:
        raise _fail(f"{path} does not exist (expected what `memtel tune --json` printed)") from None
    except (OSError, ValueError) as exc:
        raise _fail(f"{path}: not a `memtel tune --json` file ({str(exc)[:200]})") from None
    ranked = data.get("ranked") if isinstance(data, dict) else None
    if not isinstance(ranked, list) or not ranked:
        raise _fail(f"{path}: no `ranked` settings (expected what `memtel tune --json` printed)")
    if rank > len(ranked):
        raise _fail(f"rank {rank}: {path} ranks {len(ranked)} setting(s)")
    entry = ranked[rank - 1]
    setting = entry.get("setting") if isinstance(entry, dict) else None
    applied = entry.get("apply") if isinstance(entry, dict) else None
    if not isinstance(setting, dict) or not isinstance(applied, dict):
        raise _fail(f"{path}: ranked[{rank - 1}] has no `setting` and `apply`")
    env, flags = applied.get("env"), applied.get("flags")
    if (not isinstance(env, dict) or not all(isinstance(k, str) and ENV_NAME.fullmatch(k) and isinstance(v, str)
                                             and "\0" not in v and len(v) <= limits.MAX_ARG_CHARS
                                             for k, v in env.items())
            or not isinstance(flags, list) or not all(isinstance(f, str) and "\0" not in f for f in flags)):
        raise _fail(f"{path}: ranked[{rank - 1}].apply: expected env (NAME: string) and flags (strings)")
    conf = env.get(ALLOC_CONF_NAMES[0])
    if not isinstance(conf, str) or conf != setting.get("alloc_conf"):
        raise _fail(f"{path}: ranked[{rank - 1}]: the allocator settings of `apply` and `setting` differ")
    parse_alloc_conf(conf)   # torch's rules: a setting torch would reject never reaches a server
    env = {**env, ALLOC_CONF_NAMES[1]: conf}
    budget = setting.get("logits_budget_bytes")
    label = (f"{conf or 'defaults'}; budget {budget / MIB:g} MiB; chunk {setting.get('chunk')}; {setting.get('mode')}"
             if isinstance(budget, int) else conf or "defaults")
    return label, env, tuple(flags)


def apply_tuned(serve: Any, tuned: TunedArm) -> Any:
    """`serve` (a ServeSpec) with the tuned environment and flags added; ConfigError names a conflict."""
    for name, value in tuned.env.items():
        if name in serve.env and serve.env[name] != value:
            raise _fail(f"serve.env.{name} is {serve.env[name]!r} and the tuned setting sets {value!r}: leave it to "
                        "the tuned setting or drop `tune`")
    flag_names = [f for f in tuned.flags if f.startswith("--")]
    for flag in flag_names:
        if any(arg == flag or arg.startswith(flag + "=") for arg in serve.command):
            raise _fail(f"serve.command already has {flag}; the tuned setting sets it")
    return dataclasses.replace(serve, env={**serve.env, **tuned.env}, command=(*serve.command, *tuned.flags))


__all__ = ["MAX_TUNE_FILE_BYTES", "TunedArm", "apply_tuned", "read_tuned"]
