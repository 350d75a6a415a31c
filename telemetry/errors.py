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

# Exit codes: the same situation gives the same code, whatever the command (docs/cli.md, "Exit codes", writes this
# table out; tests/test_exit_codes.py holds them together).
EXIT_CODES = {
    0: "done",
    1: "a source or resource could not be used, or the work did not finish",
    2: "bad input",
    3: "`ab`: a gate failed",
    4: "`ab`: requests failed",
    130: "interrupted (Ctrl-C)",
}
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped; after a clean stop too

MAX_SHOWN_CHARS = 80     # a value quoted in an error message (a 1 MB label, a 5,000-digit integer) is cut here
MAX_ERROR_CHARS = 1000   # a whole error line, whatever it quotes


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """`value` quoted for an error message, whatever it is: its repr (control characters escaped), cut after
    `limit` characters; an integer of more than 64 bits by its size (its digits would be the message); a value
    whose repr fails (a list holding a 5,000-digit integer, a deep nesting) by its type."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length():,} bits"
    if isinstance(value, str):
        return repr(value if len(value) <= limit else value[:limit] + "...")
    if isinstance(value, bytes):
        return repr(value[:limit]) + ("..." if len(value) > limit else "")
    try:
        text = repr(value)
    except (ValueError, RecursionError, MemoryError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."


def printable(text: str, limit: int | None = None) -> str:
    """`text` safe for a terminal: every control or format character (C0 with ESC and newlines, DEL, C1, bidi
    overrides, line separators) written as its escape (`\\x1b`), cut after `limit` characters when given. For text
    from outside (a scraped label, an endpoint's error) on its way to a terminal."""
    cut = limit is not None and len(text) > limit
    if limit is not None:
        text = text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
        if limit is not None and len(text) > limit:   # the escapes made it longer
            text, cut = text[:limit], True
    return text + "..." if cut else text


class MemtelError(Exception):
    """Base of every error memtel reports to a user as one line."""

    exit_code = 1


class ConfigError(MemtelError, ValueError):
    """Bad input: a flag, a file or a setting is not what is expected (exit 2)."""

    exit_code = 2


class RunError(MemtelError, RuntimeError):
    """A run could not go on although its input was valid (exit 1)."""

    exit_code = 1


__all__ = ["MAX_ERROR_CHARS", "MAX_SHOWN_CHARS", "ConfigError", "MemtelError", "RunError", "printable", "shown"]
