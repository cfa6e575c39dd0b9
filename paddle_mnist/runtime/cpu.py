"""Choices about the CPU: MKL's AVX2 kernels on AMD processors and a fixed malloc threshold, made before Paddle
loads, and the threads each worker gets, in both OpenMP runtimes Paddle's CPU wheel loads."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator, MutableMapping

MKL_CODE_PATH = "MKL_DEBUG_CPU_TYPE"  # read once, when Paddle's bundled MKL (mklml) starts
AVX2_CODE_PATH = "5"


def cpu_flags(cpuinfo: str) -> tuple[str, set[str]]:
    """(vendor, feature flags) of the first processor listed in /proc/cpuinfo's text."""
    vendor, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return vendor, flags


def mkl_settings(cpuinfo: str, environ: MutableMapping[str, str]) -> dict[str, str]:
    """The environment settings that let MKL run its AVX2 kernels here, or {} when there is nothing to set.

    The MKL that Paddle's CPU wheels bundle picks its kernels by the processor's vendor, not its features: on an
    AMD processor it runs its generic SSE kernels, even where AVX2 and FMA are there. MKL_DEBUG_CPU_TYPE=5 makes it
    take the AVX2 path, which the convolutions of every model here run through (the gain measured is in
    docs/performance.md). Set only for AMD processors that have AVX2 and FMA (the
    path would crash without them) and never over a value the user chose.
    """
    vendor, flags = cpu_flags(cpuinfo)
    if vendor != "AuthenticAMD" or not {"avx2", "fma"} <= flags or MKL_CODE_PATH in environ:
        return {}
    return {MKL_CODE_PATH: AVX2_CODE_PATH}


def prefer_fast_kernels(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Apply mkl_settings to this process and return them. MKL reads them at its first call, so this must run
    before the first Paddle operation that reaches it (any matmul or convolution); the entry points call it first.
    """
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:  # not Linux: nothing to read, nothing to set
        return {}
    settings = mkl_settings(cpuinfo, environ)
    environ.update(settings)
    return settings


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc's malloc.h)
MMAP_THRESHOLD = 32 << 20  # the ceiling of the threshold glibc adjusts by itself on 64-bit machines
USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def steady_malloc(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Fix glibc's mmap threshold at 32 MiB for this process (and the trim threshold at twice that); True if set.

    glibc serves an allocation at or above its mmap threshold (128 KiB at the start) with a fresh memory mapping
    and unmaps it when it is freed, and it raises the threshold to the size of each such block freed, up to 32 MiB.
    So whether the activation-sized buffers of a training step come from the heap or from fresh mappings, which
    fault in page by page on every step, depends on what the process happened to free before training, and the
    same run's step time with it (docs/performance.md has the figures). Nothing is set where the user set
    either threshold (environment variables or GLIBC_TUNABLES), or where the C library is not glibc.
    """
    if any(name in environ for name in USER_MALLOC_SETTINGS) or "threshold" in environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt): nothing to set
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD))


def threads_per_worker(requested: int, local_size: int) -> int:
    """--cpu-threads, or the cores divided among this node's workers, at least one."""
    if requested:
        return requested
    return max(1, (os.cpu_count() or 1) // max(local_size, 1))


OPENMP_RUNTIMES = ("libgomp.so.1", "libiomp5.so")  # oneDNN's (GNU) and MKL's (Intel) in Paddle's CPU wheels


def set_openmp_threads(n: int) -> dict[str, int]:
    """omp_set_num_threads(n) in every OpenMP runtime this process has loaded; {runtime: its threads now}.

    Paddle's set_num_threads reaches one runtime, and its CPU wheel loads two: MKL's Intel OpenMP and the GNU
    OpenMP its libdnnl.so.3 (and so the oneDNN operators of ops/) runs on. Left alone, the second would run as many
    threads as the machine has cores in every worker.
    """
    seen = {}
    for name, lib in _loaded(OPENMP_RUNTIMES).items():
        lib.omp_set_num_threads(ctypes.c_int(n))
        seen[name] = lib.omp_get_max_threads()
    return seen


_loaded_runtimes: dict[str, ctypes.CDLL] = {}


def _loaded(names: tuple[str, ...]) -> dict[str, ctypes.CDLL]:
    """Those of the libraries named that this process has loaded, by name (kept once found)."""
    for name in names:
        if name not in _loaded_runtimes:
            try:
                _loaded_runtimes[name] = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
            except OSError:  # not loaded in this process
                continue
    return {name: _loaded_runtimes[name] for name in names if name in _loaded_runtimes}


MKL_LIBRARY = "libmklml_intel.so"  # Paddle's bundled MKL, whose own thread count outranks OpenMP's


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Inside, this thread's MKL calls and next parallel regions run on one thread (MKL's thread-local count, and
    every OpenMP runtime loaded): MKL's float32 products then add in one order whatever the process's threads
    (network/exact.py's by_rows); restored after. A library this process has not loaded is left alone."""
    openmp = _loaded(OPENMP_RUNTIMES)
    kept = {name: lib.omp_get_max_threads() for name, lib in openmp.items()}
    for lib in openmp.values():
        lib.omp_set_num_threads(ctypes.c_int(1))
    mkl = _loaded((MKL_LIBRARY,)).get(MKL_LIBRARY)
    kept_mkl = mkl.MKL_Set_Num_Threads_Local(ctypes.c_int(1)) if mkl is not None else None  # 0: the global count
    try:
        yield
    finally:
        if mkl is not None:
            mkl.MKL_Set_Num_Threads_Local(ctypes.c_int(kept_mkl))
        for name, lib in openmp.items():
            lib.omp_set_num_threads(ctypes.c_int(kept[name]))


# One process with a thread a core against a one-thread worker a core, the default model at 64 images a worker a
# step: 4,724 against 17,199 images/s on a 16-core Xeon (docs/performance.md, "N workers against the machine's
# limit"). Paddle's operators split one batch over threads less well than workers split the batches.
WORKERS_OVER_THREADS = (16, 17199 / 4724)


def workers_advice(threads: int) -> str:
    """The start-up line of one CPU process with more than 2 threads: workers are the faster way, and by how much
    where it was measured."""
    cores, times = WORKERS_OVER_THREADS
    return (
        f"one process on {threads} threads: workers of one thread each use a CPU's cores better (on a {cores}-core "
        f"Xeon, {cores} workers of 64 images a step trained the default model {times:.1f} times as fast as one "
        f"process with {cores} threads): python -m paddle.distributed.launch --nproc_per_node {threads} train.py "
        f"... --batch-size {64 * threads} gives each worker 64 images a step (docs/performance.md)"
    )
