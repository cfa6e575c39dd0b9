"""oneDNN's operators for CPU training: built once per machine and Paddle version, checked, then used, or left aside.

Paddle's dygraph runs a CPU convolution as im2col and one small MKL GEMM per image, and never reaches oneDNN
(docs/performance.md). csrc/onednn_conv.cc holds Paddle custom operators, with their gradient operators, that run
the convolution through oneDNN: onednn_conv2d, and onednn_conv2d_bias, which adds the bias inside the convolution.
csrc/max_pool.cc adds max_pool2x2, the 2x2 max-pool of stride 2 that layers.MaxPool2D runs in training, to the
bit F.max_pool2d's and, in SSE2, faster than Paddle's CPU kernel (docs/performance.md). csrc/blocked.cc runs
MiniGoogLeNet's conv modules (convolution, batch norm, ReLU), 3x3 max-pools and concatenations on maps in oneDNN's
layout blocked by BLOCK channels (conv_bn_relu, max_pool_blocked, concat_blocked); csrc/batch_norm.cc has the
per-image sums and per-channel scalings of batch norm over the global batch (network/batchnorm.py). The files build
into one library, cpu_ops, linked against the libdnnl.so.3 that Paddle's CPU wheel already ships, with the oneDNN
headers of the `onednn-devel-cpu-gomp` package (requirements.txt).

    prepare(backend)   before the process group: build (or find) the library; several workers on one machine
                       build it once, under a lock, and a damaged build is rebuilt. Never raises for "auto".
    activate(...)      after it: load the build, check it against Paddle's layers (selfcheck.py), and route
                       Conv2D, MaxPool2D and MiniGoogLeNet's training step through it (fastpath.py, what the
                       networks call)
    active()           whether it is routed so; deactivate() sets it aside

--conv-backend auto (the default) uses the operators where they build and pass the check, and Paddle's
layers with one logged line saying why where they do not; onednn requires them (a run that cannot have them
stops with the reason); paddle never builds them.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import paddle

from paddle_mnist.datasets.datafiles import file_digest
from paddle_mnist.ops import fastpath, selfcheck

BACKENDS = ("auto", "onednn", "paddle")
CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("onednn_conv.cc", "blocked.cc", "max_pool.cc", "batch_norm.cc", "matmul.cc"))
INCLUDES = (CSRC / "onednn_common.h",)  # what the sources include from beside them
NAME = "cpu_ops"  # the library's name: oneDNN's operators (onednn_conv2d(_bias), the blocked ones) and max_pool2x2
HEADERS_PACKAGE = "onednn-devel-cpu-gomp"
HEADERS_FIX = f"pip install {HEADERS_PACKAGE}==2023.2.0"
BUILD_TIMEOUT_S = 900

# Run in a child process, so that a compiler or loader failure cannot take the trainer down with it:
# paddle.utils.cpp_extension.load compiles with Paddle's own headers and flags, then loads the result once.
BUILD_SCRIPT = """
import ctypes, os, sys
from paddle.utils import cpp_extension
sources, out, include, libs, package_parent, name = sys.argv[1:7]
module = cpp_extension.load(
    name=name, sources=sources.split(os.pathsep), extra_include_paths=[include],
    extra_cxx_cflags=["-O3", "-std=c++17"],
    extra_ldflags=[f"-L{libs}", "-l:libdnnl.so.3", f"-Wl,-rpath,{libs}"],
    build_directory=out,
)
# every symbol resolved now (a missing one would otherwise end the trainer at its first call), then the check
ctypes.CDLL(os.path.join(out, name, name + ".so"), mode=os.RTLD_NOW)
sys.path.insert(0, package_parent)
from paddle_mnist.ops import selfcheck
selfcheck.check(module)
"""


class Unavailable(Exception):
    """The operator cannot be built, loaded or trusted here; the message says why and, where there is one, the fix."""


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What prepare() found: the build to load, or why there is none."""

    backend: str
    library: Path | None = None
    built_s: float | None = None  # seconds this process spent building; None: an earlier build was found
    reason: str = ""  # why Paddle's convolution is used


def cache_root(environ: dict | os._Environ = os.environ) -> Path:
    """PADDLE_MNIST_CACHE, else $XDG_CACHE_HOME/paddle_mnist, else ~/.cache/paddle_mnist."""
    if environ.get("PADDLE_MNIST_CACHE"):
        return Path(environ["PADDLE_MNIST_CACHE"])
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "paddle_mnist"


def headers() -> Path:
    """The folder that holds oneapi/dnnl/dnnl.hpp, from the installed headers package."""
    import importlib.metadata

    try:
        files = importlib.metadata.distribution(HEADERS_PACKAGE).files or []
    except importlib.metadata.PackageNotFoundError:
        raise Unavailable(f"the oneDNN headers are not installed ({HEADERS_FIX})") from None
    for f in files:
        if f.name == "dnnl.hpp" and f.parent.name == "dnnl":
            return Path(f.locate()).resolve().parent.parent.parent
    raise Unavailable(f"{HEADERS_PACKAGE} is installed without oneapi/dnnl/dnnl.hpp (reinstall it: {HEADERS_FIX})")


def paddle_libs() -> Path:
    """The folder of Paddle's bundled libraries, which holds the libdnnl.so.3 the operator links against."""
    libs = Path(paddle.__file__).parent / "libs"
    if not (libs / "libdnnl.so.3").is_file():
        raise Unavailable(f"this Paddle ({paddle.__version__}) ships no libdnnl.so.3 in {libs}")
    return libs


def compiler() -> str:
    """The C++ compiler's version line; Unavailable when there is none."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        raise Unavailable(f"no C++ compiler ({cxx}) to build it with (install g++)") from None
    return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else cxx


def build_key(include: Path, libs: Path) -> str:
    """Everything a build depends on: the source, Paddle, its libdnnl, the headers, the compiler and Python."""
    h = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + INCLUDES) + BUILD_SCRIPT.encode())
    version = (include / "oneapi" / "dnnl" / "dnnl_version.h").read_bytes()
    dnnl = (libs / "libdnnl.so.3").stat()
    commit = getattr(paddle.version, "commit", "")
    for part in (paddle.__version__, commit, version, dnnl.st_size, compiler(), sys.version, platform.machine()):
        h.update(str(part).encode())
    return h.hexdigest()[:16]


def intact(folder: Path) -> bool:
    """A finished build: its record names the library's digest, and the library still has it."""
    try:
        record = json.loads((folder / "build.json").read_text())
        return file_digest(folder / f"{NAME}.so", "sha256") == record["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _compile(folder: Path, include: Path, libs: Path) -> None:
    """Build into `folder` (a fresh scratch folder) in a child process; Unavailable with the compiler's last
    lines where it fails."""
    folder.mkdir()
    package_parent = str(Path(__file__).resolve().parents[2])
    sources = os.pathsep.join(map(str, SOURCES))
    cmd = [sys.executable, "-c", BUILD_SCRIPT, sources, str(folder), str(include), str(libs), package_parent, NAME]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"the build took over {BUILD_TIMEOUT_S} s and was stopped") from None
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if "error" in line.lower()]
        tail = lines[-1].strip() if lines else (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Unavailable(f"the build failed: {tail[:300]}")


def _say(text: str) -> None:
    """A line on stderr before the worker's log exists: a first build takes a minute and must not look hung."""
    print(f"{time.strftime('%H:%M:%S')} oneDNN operators: {text}", file=sys.stderr, flush=True)


def build(root: Path | None = None) -> tuple[Path, float | None]:
    """The built library's path, and the seconds this call spent building it (None: found built).

    The build's folder is named by build_key. It is made under an exclusive lock, so the workers of one machine
    build it once and the others wait, compiled in a scratch folder beside it and moved into place with its
    record (build.json, holding the library's SHA-256) only once complete: a folder without an intact record is a
    damaged or interrupted build and is built again, never loaded.
    """
    include, libs = headers(), paddle_libs()
    root = (root or cache_root()) / NAME
    key = build_key(include, libs)
    folder = root / key
    if intact(folder):
        return folder / f"{NAME}.so", None
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{key}.lock", "a")
    except OSError as e:
        raise Unavailable(f"cannot write the build cache {root}: {e.strerror} (set PADDLE_MNIST_CACHE)") from None
    with lock:
        try:  # released when the file closes, also if this process dies
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"another process on this machine is building them into {folder}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if intact(folder):  # another worker built it while this one waited
            return folder / f"{NAME}.so", None
        _say(
            f"building them for this machine into {folder}, once (23 to 46 s on an idle 2-core machine, longer on "
            "a busy one; later runs load them)"
        )
        started = time.perf_counter()
        scratch = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        try:
            _compile(scratch / "build", include, libs)
            staged = scratch / "staged"
            staged.mkdir()
            shutil.copyfile(scratch / "build" / NAME / f"{NAME}.so", staged / f"{NAME}.so")
            seconds = time.perf_counter() - started
            record = {
                "sha256": file_digest(staged / f"{NAME}.so", "sha256"),
                "paddle": paddle.__version__,
                "build_seconds": round(seconds, 1),
                "compiler": compiler(),
            }
            (staged / "build.json").write_text(json.dumps(record, indent=2) + "\n")
            if folder.exists():  # damaged or interrupted: set it aside whole, then put the new build in its place
                shutil.rmtree(folder)
            os.replace(staged, folder)
        except OSError as e:
            raise Unavailable(f"cannot write the build cache {root}: {e} (set PADDLE_MNIST_CACHE)") from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return folder / f"{NAME}.so", seconds


def prepare(backend: str) -> Prepared:
    """Build or find the operator for this run's --conv-backend; raises Unavailable only for "onednn"."""
    if backend == "paddle":
        return Prepared(backend, reason="--conv-backend paddle")
    try:
        if paddle.is_compiled_with_cuda():
            raise Unavailable("this Paddle is a GPU build, whose convolutions run on the GPU")
        if not sys.platform.startswith("linux"):
            raise Unavailable("the operator is built on Linux only")
        library, seconds = build()
    except Unavailable as e:
        if backend == "onednn":
            raise
        return Prepared(backend, reason=str(e))
    return Prepared(backend, library, seconds)


_loaded: dict[str, object] = {}  # library path -> its module: Paddle registers a library's operators once a process


def load(library: Path):
    """Register the operators from their library and return their Python module (the same one on a second call:
    a second registration would find no new operators)."""
    from paddle.utils.cpp_extension import extension_utils

    if str(library) in _loaded:
        return _loaded[str(library)]
    with tempfile.TemporaryDirectory() as scratch:  # the generated Python wrapper is read once, at import
        names = extension_utils.load_op_meta_info_and_register_op(str(library))
        module = extension_utils._generate_python_module(NAME, names, scratch)
    _loaded[str(library)] = module
    return module


def activate(prepared: Prepared, device: str) -> str:
    """Load and check the prepared build and route the networks through it (fastpath); the line the log gets about
    it. Raises Unavailable where the user asked for oneDNN and cannot have it."""
    fastpath.use(None)
    if prepared.library is None:
        return f"convolutions: Paddle's ({prepared.reason})"
    if device != "cpu":
        if prepared.backend == "onednn":
            raise Unavailable(f"--conv-backend onednn runs on the CPU; this run's device is {device}")
        return f"convolutions: Paddle's (device {device})"
    try:
        ops = load(prepared.library)
        selfcheck.check(ops)
    except selfcheck.Refused as e:
        if prepared.backend == "onednn":
            raise Unavailable(str(e)) from None
        return f"convolutions: Paddle's (oneDNN's operator from {prepared.library} was not used: {e})"
    except Exception as e:  # a library that loads but fails: Paddle's message, on one line
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        if prepared.backend == "onednn":
            raise Unavailable(f"oneDNN's operator from {prepared.library} failed to load: {reason}") from None
        return f"convolutions: Paddle's (oneDNN's operator from {prepared.library} failed to load: {reason})"
    fastpath.use(ops)
    how = f"built in {prepared.built_s:.0f} s" if prepared.built_s is not None else "built before"
    return f"convolutions: oneDNN (custom operator, {how}: {prepared.library})"


def deactivate() -> None:
    fastpath.use(None)


def active() -> bool:
    """Whether activate() routed the networks through the operators."""
    return fastpath.active()
