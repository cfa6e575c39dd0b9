"""Choices about the CPU made before Paddle loads: MKL's AVX2 kernels on AMD processors."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

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
    take the AVX2 path, which the convolutions of every model here run through (1.3 to 2.5x faster on this
    project's AMD EPYC machines, docs/performance.md). Set only for AMD processors that have AVX2 and FMA (the
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
