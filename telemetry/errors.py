"""memtel's exception hierarchy, in one place.

Every error that a user's input or a run's circumstances can cause derives from `MemtelError`, so
the command line (telemetry/cli.py) turns any of them into one line on stderr and a non-zero exit
without a traceback:

- `ConfigError`: bad input (a flag, a file, a ladder, an environment variable): exit 2. The message
  says what was wrong and what is expected.
- `RunError`: the input was fine but the run could not go on (a server that does not start, a run
  directory in use, a device that is missing): exit 1.

Modules subclass these (`LadderError(ConfigError)`, `ServeError(RunError)`, ...) so callers catch the
family they mean, not an ad-hoc list. The hook never raises them into the serving process: it counts
and logs its own failures (docs/hook.md).
"""

from __future__ import annotations


class MemtelError(Exception):
    """Base of every error memtel reports to a user as one line."""

    exit_code = 1


class ConfigError(MemtelError, ValueError):
    """Bad input: a flag, a file or a setting is not what is expected (exit 2)."""

    exit_code = 2


class RunError(MemtelError, RuntimeError):
    """A run could not go on although its input was valid (exit 1)."""

    exit_code = 1


__all__ = ["ConfigError", "MemtelError", "RunError"]
