"""datafiles: the SHA256SUMS lists read back and the file digest; no Paddle needed."""

from __future__ import annotations

import hashlib

import pytest

from paddle_mnist.datasets import datafiles, download
from paddle_mnist.datasets.formats import DataError


def test_sums_are_read_in_sha256sums_format(tmp_path):
    (tmp_path / "a.gz").write_bytes(b"a")
    (tmp_path / "b.gz").write_bytes(b"b")
    digest_a = hashlib.sha256(b"a").hexdigest()
    digest_b = hashlib.sha256(b"b").hexdigest()
    assert datafiles.read_sums(tmp_path) is None  # no list
    (tmp_path / datafiles.SUMS).write_text(f"{digest_a}  a.gz\n\n{digest_b.upper()} *b.gz\n")
    assert datafiles.read_sums(tmp_path) == {"a.gz": digest_a, "b.gz": digest_b}
    assert datafiles.file_digest(tmp_path / "a.gz", "sha256") == digest_a
    assert download.sums_intact(tmp_path, ["a.gz", "b.gz"])
    assert not download.sums_intact(tmp_path, ["a.gz", "c.gz"])  # c.gz is not listed


def test_a_damaged_sums_list_is_named_and_vouches_for_nothing(tmp_path):
    (tmp_path / "a.gz").write_bytes(b"a")
    (tmp_path / datafiles.SUMS).write_text(f"{hashlib.sha256(b'a').hexdigest()}  a.gz\ncut-short\n")
    with pytest.raises(DataError, match=r"SHA256SUMS:2: want '<sha256>  <name>', found 'cut-short'"):
        datafiles.read_sums(tmp_path)
    assert not download.sums_intact(tmp_path, ["a.gz"])  # so download fetches or builds again, and lists anew
