"""Quoting outside text (telemetry.errors): `shown` in an error message, `printable` on a terminal, and every
command's error line cut and escaped whatever it quotes (issue 27: a 2 MB error line; escapes reaching the
operator's terminal)."""

from __future__ import annotations

from telemetry.cli import error_line
from telemetry.errors import MAX_ERROR_CHARS, printable, shown


def test_shown_cuts_long_values_and_names_huge_integers():
    assert shown("x" * 1_000_000) == repr("x" * 80 + "...")
    assert shown(b"\x80" * 1000, 8) == repr(b"\x80" * 8) + "..."
    assert shown(1 << 8_000_000) == "an integer of 8,000,001 bits"
    assert shown([10**5000]) == "a list"          # its repr fails past Python's digit limit
    assert shown("a\x1b[2J") == "'a\\x1b[2J'"      # repr escapes


def test_printable_escapes_every_character_a_terminal_acts_on():
    raw = "ok \x00\x07\x08\t\n\r\x1b]0;t\x07\x7f\x85\x9b\u202e\u2028 end"
    text = printable(raw)
    assert all(c.isprintable() for c in text)
    assert text == "ok \\x00\\x07\\x08\\t\\n\\r\\x1b]0;t\\x07\\x7f\\x85\\x9b\\u202e\\u2028 end"
    assert printable("é ü 日本 plain") == "é ü 日本 plain"
    assert printable("y" * 100, 10) == "y" * 10 + "..."


def test_every_error_line_is_cut_and_escaped_keeping_its_lines():
    line = error_line("memtel x", "bad \x1b[2J" + "z" * 2_000_000 + "\nsecond\x9b")
    first, second = line.split("\n")
    assert len(first) <= len("memtel x: error: ") + MAX_ERROR_CHARS + 3 and "\\x1b[2J" in first
    assert second == "second\\x9b"
