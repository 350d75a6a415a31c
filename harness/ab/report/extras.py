"""What a report's first writer added to the harness's report (sections, notes, plot caveats), kept beside it.

`memtel demo` writes its run's report with a section of its own, a note on what the TTFT difference is not, and
a caveat drawn into the TTFT plot. Report.write keeps them in the run directory (`report-extras.json`), so that
`memtel ab report DIR` written again later keeps them too instead of dropping them without a word. The file is
read as hostile (any run directory may be handed to `ab report`): a file that is not what Report.write writes is
refused in one line, never half-used.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.ab.report.markdown import Section
from telemetry.errors import ConfigError

EXTRAS_FILE = "report-extras.json"
MAX_EXTRAS_BYTES = 8 << 20


@dataclass(frozen=True)
class ReportExtras:
    sections: tuple[Section, ...] = ()
    notes: Mapping[str, Sequence[str]] | None = None
    plot_caveats: Mapping[str, str] | None = None

    def __bool__(self) -> bool:
        return bool(self.sections or self.notes or self.plot_caveats)


def save_extras(run_dir: Path, extras: ReportExtras, plain: Callable[[Any], Any]) -> None:
    """Write `extras` into `run_dir`; `plain` makes a section's data plain JSON as summary.json's is made."""
    data = {"sections": [asdict(section) for section in extras.sections], "notes": dict(extras.notes or {}),
            "plot_caveats": dict(extras.plot_caveats or {})}
    (run_dir / EXTRAS_FILE).write_text(json.dumps(plain(data), indent=1, allow_nan=False) + "\n")


def load_extras(run_dir: Path) -> ReportExtras:
    """The extras Report.write kept in `run_dir`; empty where it kept none. ConfigError for a file that is not
    theirs."""
    path = run_dir / EXTRAS_FILE
    if not path.is_file():
        return ReportExtras()
    problem = f"{path} is not what a report's writer keeps there"
    try:
        if path.stat().st_size > MAX_EXTRAS_BYTES:
            raise ConfigError(f"{problem} (over {MAX_EXTRAS_BYTES >> 20} MiB); delete it to write the report "
                              "without its extras")
        data = json.loads(path.read_text(encoding="utf-8"))
        return ReportExtras(tuple(_section(s) for s in _list(data["sections"])), _notes(data["notes"]),
                            _caveats(data["plot_caveats"]))
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{problem} ({type(exc).__name__}); delete it to write the report without its "
                          "extras") from None


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError("not a list")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("not text")
    return value


def _section(value: Any) -> Section:
    if not isinstance(value, dict) or value.get("placement") not in ("lead", "tail"):
        raise TypeError("not a section")
    return Section(_text(value["key"]), _text(value["title"]), _text(value["body"]), value["placement"],
                   value.get("data"))


def _notes(value: Any) -> dict[str, list[str]]:
    if not isinstance(value, dict):
        raise TypeError("not a mapping")
    return {_text(key): [_text(line) for line in _list(lines)] for key, lines in value.items()}


def _caveats(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise TypeError("not a mapping")
    return {_text(key): _text(text) for key, text in value.items()}


__all__ = ["EXTRAS_FILE", "ReportExtras", "load_extras", "save_extras"]
