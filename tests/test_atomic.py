"""atomic: files written whole or not at all; no Paddle needed."""

from __future__ import annotations

import pytest

from paddle_mnist.files import atomic


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_write_that_succeeds_replaces_the_target_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "config.json"
    target.write_text("old\n")
    atomic.write_text(target, "new\n")
    assert target.read_text() == "new\n"
    atomic.write_bytes(target, b"\x00\x01", fsync=True)
    assert target.read_bytes() == b"\x00\x01"
    assert names(tmp_path) == ["config.json"]


def test_a_write_that_fails_leaves_the_target_as_it_was_and_no_temporary_file(tmp_path):
    target = tmp_path / "metrics.jsonl"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic.atomic_write(target) as f:
            f.write(b"half of the new content")
            f.flush()
            assert atomic.temp_beside(target).read_bytes() == b"half of the new content"  # beside, not over it
            raise RuntimeError("disk full")
    assert target.read_bytes() == b"old"
    assert names(tmp_path) == ["metrics.jsonl"]


def test_a_first_write_that_fails_creates_no_file(tmp_path):
    with pytest.raises(OSError):
        with atomic.atomic_path(tmp_path / "model.onnx", suffix=".partial") as tmp:
            assert tmp == tmp_path / ".model.onnx.partial"
            tmp.write_bytes(b"a converter's half-written file")
            raise OSError(28, "No space left on device")
    assert names(tmp_path) == []


def test_a_writer_that_wants_a_file_name_writes_the_temporary_path(tmp_path):
    target = tmp_path / "curves.png"
    with atomic.atomic_path(target, fsync=True) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".curves.png.tmp")  # same folder: a plain rename
        tmp.write_bytes(b"png")
        assert not target.exists()  # nothing under the real name until the block ends
    assert target.read_bytes() == b"png"
    assert names(tmp_path) == ["curves.png"]


def test_only_whole_file_modes_are_taken(tmp_path):
    with pytest.raises(ValueError, match="mode 'wb' or 'w'"):
        with atomic.atomic_write(tmp_path / "metrics.jsonl", "a"):
            pass
    assert names(tmp_path) == []
