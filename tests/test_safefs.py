"""telemetry/safefs.py on real files: other users' directories, planted symlinks, a full tmpfs, huge files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from telemetry.safefs import (
    FileTooLargeError,
    UnsafePathError,
    create_private,
    ensure_private_dir,
    move_aside,
    read_capped,
    remove_stale_temporaries,
    write_atomic,
)
from tests.support.tmpfs import SmallTmpfs, fill

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create files owned by another user")


def test_ensure_private_dir_creates_0700_and_accepts_its_own(tmp_path):
    made = ensure_private_dir(tmp_path / "a" / "state")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert ensure_private_dir(made) == made  # again: fine
    with pytest.raises(UnsafePathError, match="does not exist"):
        ensure_private_dir(tmp_path / "missing", create=False)


@root_only
def test_a_directory_another_user_created_first_is_refused(tmp_path):
    planted = tmp_path / "state"
    planted.mkdir(mode=0o755)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match=f"owned by uid {NOBODY}"):
        ensure_private_dir(planted, what="state directory")


def test_group_or_world_writable_directory_is_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(UnsafePathError, match="writable by group or others"):
        ensure_private_dir(loose)


@root_only
def test_a_symlink_another_user_planted_is_refused_and_a_root_one_followed(tmp_path):
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    planted = tmp_path / "planted"
    planted.symlink_to(target)
    os.lchown(planted, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match="symbolic link owned by uid"):
        ensure_private_dir(planted)
    trusted = tmp_path / "trusted"  # like systemd's StateDirectory= link under DynamicUser=
    trusted.symlink_to(target)
    assert ensure_private_dir(trusted) == trusted


@root_only
def test_a_directory_under_another_users_parent_is_refused(tmp_path):
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, NOBODY, NOBODY)
    mine = parent / "state"
    mine.mkdir(mode=0o700)
    with pytest.raises(UnsafePathError, match="who could replace it"):
        ensure_private_dir(mine)


def test_a_world_writable_parent_needs_the_sticky_bit(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    mine = parent / "state"
    mine.mkdir(mode=0o700)
    with pytest.raises(UnsafePathError, match="without the sticky bit"):
        ensure_private_dir(mine)
    parent.chmod(0o1777)  # like /tmp: only an entry's owner can rename it
    assert ensure_private_dir(mine) == mine


def test_write_atomic_replaces_a_planted_symlink_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "root-only"
    victim.write_text("secret")
    victim.chmod(0o600)
    state = tmp_path / "state.json"
    state.symlink_to(victim)
    write_atomic(state, b"{}")
    assert victim.read_text() == "secret"
    assert not state.is_symlink() and state.read_bytes() == b"{}"
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        create_private(state)  # O_EXCL


def test_write_atomic_on_a_full_tmpfs_detects_the_short_write_and_keeps_the_old_file(tmp_path):
    # The reported case: 4,096 of 9,252 bytes written, the truncated state replacing the good one.
    with SmallTmpfs(tmp_path / "small", 65536) as small:
        path = small / "state.json"
        write_atomic(path, b"good" * 100)
        fill(small, leave_bytes=4096)  # exactly one page left
        with pytest.raises(OSError) as info:
            write_atomic(path, b"x" * 9252)
        assert info.value.errno == 28  # ENOSPC after the short write, not silently truncated
        assert path.read_bytes() == b"good" * 100
        assert sorted(p.name for p in small.iterdir()) == ["filler", "state.json"]  # no temporary left


def test_read_capped_refuses_large_files_symlinks_and_fifos_without_reading_them(tmp_path):
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(2 << 30)  # 2 GB, sparse: refused by its size, never read
    with pytest.raises(FileTooLargeError, match="more than the 1024 expected"):
        read_capped(big, 1024)
    (tmp_path / "small").write_bytes(b"abc")
    assert read_capped(tmp_path / "small", 3) == b"abc"
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "small")
    with pytest.raises(OSError):
        read_capped(link, 1024)
    assert read_capped(link, 1024, follow_symlinks=True) == b"abc"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        read_capped(fifo, 1024)  # returns at once: no writer is waited for


def test_move_aside_keeps_a_bounded_number_of_copies(tmp_path):
    path = tmp_path / "state.json"
    for i in range(8):
        path.write_text(str(i))
        aside = move_aside(path, keep=3)
        assert aside.name.startswith("state.json.corrupt-") and not path.exists()
    kept = sorted(p.read_text() for p in tmp_path.glob("state.json.corrupt-*"))
    assert kept == ["5", "6", "7"]


def test_remove_stale_temporaries_removes_leftovers_and_links_but_not_their_targets(tmp_path):
    path = tmp_path / "state.json"
    (tmp_path / ".state.json.abc123.tmp").write_text("torn")
    target = tmp_path / "keep-me"
    target.write_text("x")
    (tmp_path / ".state.json.def456.tmp").symlink_to(target)
    (tmp_path / ".other.json.abc.tmp").write_text("not ours")
    assert remove_stale_temporaries(path) == 2
    assert target.read_text() == "x" and (tmp_path / ".other.json.abc.tmp").exists()
    assert not list(tmp_path.glob(".state.json.*.tmp"))


def test_ensure_private_dir_reports_what_it_cannot_use(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(UnsafePathError, match="Not a directory"):
        ensure_private_dir(afile / "state")
    with pytest.raises(UnsafePathError, match="is not a directory"):
        ensure_private_dir(afile)
    assert isinstance(UnsafePathError("x"), ValueError)  # a ConfigError: exit 2 through the CLI
    assert not Path(afile / "state").exists()
