"""Writing a file whole or not at all: into a temporary file beside it, renamed over it once the write succeeded.

A crash, a full disk or a signal mid-write never leaves half a file under the real name, and never touches the
file already there; whatever fails, the temporary file is removed (a killed process is the one exception: its
hidden .NAME.tmpPID stays). Imports nothing from the package, so any module can use it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def temp_beside(path: Path, suffix: str | None = None) -> Path:
    """The temporary file for path: .NAME + suffix (.tmpPID unless given) in path's own folder, so the rename stays
    on one file system (atomic there) and two processes writing the same file never share a temporary file."""
    path = Path(path)
    return path.with_name(f".{path.name}{f'.tmp{os.getpid()}' if suffix is None else suffix}")


def sync(path: Path) -> None:
    """Force a written file's content to disk (fsync), so after a power cut it is there whole."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: Path, *, suffix: str | None = None, fsync: bool = False) -> Iterator[Path]:
    """Yield the temporary path for path's new content, for writers that want a file name (paddle.save, a
    converter); when the block ends without an exception it is renamed over path. fsync: force the content to
    disk before the rename, so after a power cut path holds the old content or the new, never a hole."""
    path = Path(path)
    tmp = temp_beside(path, suffix)
    try:
        yield tmp
        if fsync:
            sync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "wb", *, suffix: str | None = None, fsync: bool = False) -> Iterator[IO]:
    """Yield a file open for writing (mode "wb" or "w") on path's temporary file; see atomic_path."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write writes a whole new file: pass mode 'wb' or 'w', not {mode!r}")
    with atomic_path(path, suffix=suffix, fsync=fsync) as tmp, open(tmp, mode) as f:
        yield f


def write_bytes(path: Path, data: bytes, *, fsync: bool = False) -> None:
    """Path.write_bytes, atomically."""
    with atomic_write(path, "wb", fsync=fsync) as f:
        f.write(data)


def write_text(path: Path, text: str, *, fsync: bool = False) -> None:
    """Path.write_text (in the locale's encoding, as Path.write_text), atomically."""
    with atomic_write(path, "w", fsync=fsync) as f:
        f.write(text)
