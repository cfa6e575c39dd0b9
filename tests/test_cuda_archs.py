"""scripts/cuda_archs.py reads the CUDA code in a library's fat binaries, in the layout nvcc writes.

The library here is built in the test: a 64-bit ELF with a .nv_fatbin section of two containers, laid out as in
paddlepaddle-gpu 2.6.2's libphi.so (whose own survey is in docs/results.md)."""

from __future__ import annotations

import struct

from scripts import cuda_archs


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = cuda_archs.ENTRY.pack(kind, 0x101, 64, len(payload), 0, 0, 0, 0, arch)
    header += b"\0" * (cuda_archs.FLAGS_AT - len(header)) + struct.pack("<Q", 0x11)  # 64-bit, linux
    return header + b"\0" * (64 - len(header)) + payload


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return cuda_archs.CONTAINER.pack(cuda_archs.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf_with(section: bytes) -> bytes:
    """ELF header, the section names, the fat binaries, then three section headers (null, names, fatbin)."""
    names = b"\0.shstrtab\0.nv_fatbin\0"
    names_at, fatbin_at = 64, 64 + len(names)
    table_at = fatbin_at + len(section)
    header = b"\x7fELF" + bytes([2, 1, 1]) + b"\0" * 9
    header += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, table_at, 0, 64, 56, 0, 64, 3, 1)

    def shdr(name: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, offset, size, 0, 0, 1, 0)

    table = b"\0" * 64 + shdr(1, names_at, len(names)) + shdr(11, fatbin_at, len(section))
    return header + names + section + table


def test_the_survey_and_the_verdict_per_card(tmp_path):
    cubin = b"\x7fELF" + b"\1" * 60
    sass_only = container(entry(2, 80, cubin), entry(2, 86, cubin))
    with_ptx = container(entry(2, 86, cubin), entry(1, 80, b".version 7.8\0" + b"\0" * 3))
    library = tmp_path / "libfake.so"
    library.write_bytes(elf_with(sass_only + b"\0" * 8 + with_ptx))  # containers sit 8-byte aligned

    found = cuda_archs.survey(library.read_bytes())
    assert found["containers"] == 2
    assert dict(found["counts"]) == {(2, 80): 1, (2, 86): 2, (1, 80): 1}
    image = library.read_bytes()
    groups = [entries for _, _, entries in cuda_archs.containers(image, *cuda_archs.fatbin_section(image))]
    verdict = {cap: [cuda_archs.runs_on({(e[0], e[1]): 1 for e in g}, cap) for g in groups] for cap in (80, 89, 90)}
    assert verdict == {80: ["sass", "ptx-jit"], 89: ["sass", "sass"], 90: ["no", "ptx-jit"]}

    cuda_archs.extract(library, tmp_path / "out", {86})
    assert (tmp_path / "out" / "sm86.cubin").read_bytes() == cubin
    assert (tmp_path / "out" / "sm86-container.fatbin").read_bytes() == sass_only


def test_a_file_that_is_not_elf_is_refused(tmp_path):
    try:
        cuda_archs.fatbin_section(b"PK\3\4" + b"\0" * 60)
    except ValueError as error:
        assert "not a 64-bit ELF" in str(error)
    else:
        raise AssertionError("a zip header was read as ELF")
