"""harness/ports.py: free ports outside the kernel's ephemeral range, never the same one twice in a process."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from harness import ports


def test_blocks_are_outside_the_ephemeral_range_free_and_never_handed_out_twice() -> None:
    low, high = ports.ephemeral_range()
    seen: set[int] = set()
    for _ in range(300):
        base = ports.free_port_block(3)
        block = set(range(base, base + 3))
        assert not block & seen, "a port was handed out twice"
        seen |= block
        assert all(p < low or p > high for p in block), (base, low, high)
    # Each port of the last block can be listened on now.
    socks = []
    try:
        for port in range(base, base + 3):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind(("127.0.0.1", port))
            sock.listen()
    finally:
        for sock in socks:
            sock.close()


def test_a_port_someone_listens_on_is_not_handed_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # A range that leaves exactly one candidate outside it below: the busy port, then nothing else to try.
        (tmp_path / "range").write_text(f"{taken + 1} 65535\n")
        monkeypatch.setattr(ports, "_PORT_RANGE", tmp_path / "range")
        monkeypatch.setattr(ports, "_LOWEST", taken)
        with pytest.raises(ports.RunError, match=r"no block of 1 free ports found on 127\.0\.0\.1"):
            ports.free_port_block(1, attempts=20)


def test_where_the_range_leaves_no_room_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "range").write_text("1024 65535\n")
    monkeypatch.setattr(ports, "_PORT_RANGE", tmp_path / "range")
    base = ports.free_port_block(2)
    assert 1024 <= base <= 65534
    monkeypatch.setattr(ports, "_PORT_RANGE", tmp_path / "missing")
    assert ports.ephemeral_range() == (32768, 60999)
