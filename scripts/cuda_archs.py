"""Which GPUs a Paddle build can run on: the CUDA code compiled into its libraries, read without a GPU.

A CUDA library carries its kernels in fat binaries: machine code (SASS) for some compute capabilities and,
optionally, PTX that the driver can compile for newer ones. SASS for capability X.y runs only on X.z with z >= y, so
a build with SASS up to 8.6 and no PTX cannot start a kernel on a 9.0 card (H100, H200).

    python -m scripts.cuda_archs inspect paddlepaddle_gpu-2.6.2-cp312-cp312-manylinux1_x86_64.whl
    python -m scripts.cuda_archs inspect /path/to/site-packages/paddle/libs/libphi.so
    python -m scripts.cuda_archs extract libphi.so DIR     # one kernel group's cubins, for `load`
    python -m scripts.cuda_archs load DIR/*.cubin DIR/*.fatbin   # on a GPU: does the driver accept them?

`inspect` and `extract` need only the standard library and readelf-free ELF parsing; `load` calls the CUDA
driver (libcuda.so.1) through ctypes, so it runs on a GPU machine without Paddle.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import mmap
import struct
import sys
import zipfile
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
CONTAINER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries that follow
ENTRY = struct.Struct("<HHIQIIHHI")  # kind, -, header size, payload size, -, -, minor, major, arch
FLAGS_AT = 40  # the entry's 64-bit flags, from the entry's start
COMPRESSED = 0x2000
KINDS = {1: "ptx", 2: "sass"}


def fatbin_section(image: bytes | mmap.mmap) -> tuple[int, int] | None:
    """(file offset, size) of the .nv_fatbin section of a 64-bit little-endian ELF, or None if it has none."""
    if image[:4] != b"\x7fELF" or image[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    (shoff,) = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    names_at = struct.unpack_from("<Q", image, shoff + shstrndx * shentsize + 0x18)[0]
    for index in range(shnum):
        at = shoff + index * shentsize
        name_offset = struct.unpack_from("<I", image, at)[0]
        end = image.find(b"\0", names_at + name_offset)
        if image[names_at + name_offset : end] == b".nv_fatbin":
            offset, size = struct.unpack_from("<QQ", image, at + 0x18)
            return offset, size
    return None


def containers(image, offset: int, size: int):
    """Each fat binary in the section: (its offset, its end, [(kind, arch, compressed, entry offset,
    header size, payload size), ...])."""
    at, end = offset, offset + size
    while at + CONTAINER.size <= end:
        magic, _, header, body = CONTAINER.unpack_from(image, at)
        if magic != FATBIN_MAGIC:  # containers are 8-byte aligned, with padding between
            at += 8
            continue
        entries, entry, stop = [], at + header, at + header + body
        while entry + ENTRY.size <= stop:
            kind, _, entry_header, payload, _, _, _, _, arch = ENTRY.unpack_from(image, entry)
            flags = struct.unpack_from("<Q", image, entry + FLAGS_AT)[0]
            entries.append((kind, arch, bool(flags & COMPRESSED), entry, entry_header, payload))
            entry += entry_header + payload
        yield at, stop, entries
        at = stop


def survey(image) -> dict:
    """Per (kind, arch): the number of entries and their bytes; and the number of containers."""
    found = fatbin_section(image)
    counts: collections.Counter = collections.Counter()
    sizes: collections.Counter = collections.Counter()
    total = 0
    if found:
        for _, _, entries in containers(image, *found):
            total += 1
            for kind, arch, _, _, _, payload in entries:
                counts[kind, arch] += 1
                sizes[kind, arch] += payload
    return {"containers": total, "counts": counts, "bytes": sizes}


def runs_on(counts, capability: int) -> str:
    """Whether a container whose entries are these (kind, arch) pairs runs on `capability` (e.g. 90): 'sass',
    'ptx-jit' or 'no'."""
    major = capability // 10
    if any(kind == 2 and arch // 10 == major and arch <= capability for kind, arch in counts):
        return "sass"
    if any(kind == 1 and arch <= capability for kind, arch in counts):
        return "ptx-jit"
    return "no"


def libraries(path: Path):
    """(name, image) for each shared library in a wheel, or the one library `path`."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            for name in wheel.namelist():
                if ".so" in Path(name).name:
                    yield name, wheel.read(name)
    else:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as image:
            yield str(path), image


def inspect(paths: list[Path], capabilities: list[int]) -> None:
    for path in paths:
        for name, image in libraries(path):
            found = survey(image)
            if not found["containers"]:
                continue
            counts = found["counts"]
            print(f"{name}: {found['containers']} fat binaries")
            for kind, arch in sorted(counts):
                mb = found["bytes"][kind, arch] / 1e6
                print(f"  {KINDS.get(kind, kind)} sm_{arch}: {counts[kind, arch]} entries, {mb:.1f} MB")
            # a kernel group runs only if its own container has code for the card: judge per container
            groups = [{(e[0], e[1]) for e in entries} for _, _, entries in containers(image, *fatbin_section(image))]
            for capability in capabilities:
                verdicts: collections.Counter = collections.Counter(runs_on(g, capability) for g in groups)
                shown = ", ".join(f"{verdict} {n}" for verdict, n in sorted(verdicts.items()))
                print(f"  compute capability {capability / 10:.1f}: containers {shown}")


def extract(path: Path, folder: Path, archs: set[int]) -> None:
    """Write, for each arch, one uncompressed cubin and the whole container it came from."""
    folder.mkdir(parents=True, exist_ok=True)
    for _, image in libraries(path):
        found = fatbin_section(image)
        if not found:
            continue
        for start, stop, entries in containers(image, *found):
            for kind, arch, compressed, entry, header, payload in entries:
                if kind != 2 or compressed or arch not in archs or payload > 1_000_000:
                    continue
                cubin = bytes(image[entry + header : entry + header + payload])
                (folder / f"sm{arch}.cubin").write_bytes(cubin)
                (folder / f"sm{arch}-container.fatbin").write_bytes(bytes(image[start:stop]))
                archs = archs - {arch}
                print(f"sm_{arch}: cubin {len(cubin)} bytes; its container holds {[e[1] for e in entries]}")
            if not archs:
                return


def load(files: list[Path]) -> int:
    """Load each file with cuModuleLoadData on GPU 0; print the driver's answer. 0 if the driver could be asked."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        print(f"error: no CUDA driver here ({error}); run `load` on a GPU machine", file=sys.stderr)
        return 2
    device, context, module = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    major, minor, name = ctypes.c_int(), ctypes.c_int(), ctypes.create_string_buffer(100)
    for call in (cuda.cuInit(0), cuda.cuDeviceGet(ctypes.byref(device), 0)):
        if call:
            print(f"error: the CUDA driver answered {call} before any module was loaded", file=sys.stderr)
            return 2
    cuda.cuDeviceGetName(name, 100, device)
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)
    cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
    cuda.cuCtxSetCurrent(context)
    print(f"device: {name.value.decode()}, compute capability {major.value}.{minor.value}")
    text = ctypes.c_char_p()
    for path in files:
        data = ctypes.create_string_buffer(path.read_bytes())
        code = cuda.cuModuleLoadData(ctypes.byref(module), data)
        cuda.cuGetErrorName(code, ctypes.byref(text))
        print(f"{path.name}: {code} {text.value.decode() if text.value else ''}")
        if code == 0:
            cuda.cuModuleUnload(module)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    look = verbs.add_parser("inspect", help="list the SASS and PTX architectures in a wheel or library")
    look.add_argument("paths", nargs="+", type=Path)
    look.add_argument("--capability", type=int, nargs="*", default=[80, 86, 89, 90], help="e.g. 90 for 9.0")
    pick = verbs.add_parser("extract", help="write one small kernel group's cubins and containers")
    pick.add_argument("library", type=Path)
    pick.add_argument("folder", type=Path)
    pick.add_argument("--arch", type=int, nargs="+", default=[61, 80, 86, 90])
    ask = verbs.add_parser("load", help="ask the CUDA driver on this machine to load each file")
    ask.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.verb == "inspect":
        inspect(args.paths, args.capability)
        return 0
    if args.verb == "extract":
        extract(args.library, args.folder, set(args.arch))
        return 0
    return load(args.files)


if __name__ == "__main__":
    sys.exit(main())
