"""User regular expressions (kernel-log patterns, process roles), compiled with RE2: linear time, always.

Python's `re` backtracks: `^(a+)+$` against a 34-character line takes minutes, and a kernel-log
pattern runs on the follower's thread (a role pattern on the scrape's), so one such pattern froze
`/metrics` and SIGTERM alike. RE2 (google-re2) matches in time linear in the line, whatever the
pattern; it has no backreferences or lookaround, the constructs that need backtracking, and a
pattern using them is refused at `--check-config` and at start with one line. Its memory per
pattern is capped too (`MAX_PATTERN_MEMORY`), so a pattern like `(a{1000}){1000}` is refused, not
compiled into gigabytes.
"""

from __future__ import annotations

from typing import Any, Protocol

from telemetry.errors import ConfigError

MAX_PATTERN_CHARS = 1024
MAX_PATTERN_MEMORY = 8 << 20  # bytes of RE2 program per pattern (RE2's own default)


class Searcher(Protocol):
    """What a compiled pattern offers the classifier and the process collector."""

    def search(self, text: str) -> Any: ...


def compile_user_pattern(text: Any, where: str) -> Searcher:
    """Compile a user's pattern with RE2; ConfigError says what is wrong and what RE2 does not offer."""
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{where}: expected a regular expression (a non-empty string), got {text!r}")
    if len(text) > MAX_PATTERN_CHARS:
        raise ConfigError(f"{where}: the regular expression is {len(text)} characters long; at most "
                          f"{MAX_PATTERN_CHARS} are accepted")
    import re2

    options = re2.Options()
    options.log_errors = False  # RE2 would print its own line on stderr; ours says it once
    options.max_mem = MAX_PATTERN_MEMORY
    try:
        searcher: Searcher = re2.compile(text, options)
        return searcher
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        hint = ""
        if "perl operator" in reason or "escape sequence: \\" in reason:
            hint = (" (memtel matches with RE2, in linear time: lookaround and backreferences, which need "
                    "backtracking, are not available)")
        raise ConfigError(f"{where}: bad regular expression {text!r}: {reason}{hint}") from None


__all__ = ["MAX_PATTERN_CHARS", "Searcher", "compile_user_pattern"]
