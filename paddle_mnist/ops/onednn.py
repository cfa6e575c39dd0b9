"""oneDNN convolutions for CPU training: built once per machine and Paddle version, checked, used, or left aside.

Paddle's dygraph runs a CPU convolution as im2col and one small MKL GEMM per image, and never reaches oneDNN
(docs/performance.md). csrc/onednn_conv.cc holds Paddle custom operators, with their gradient operators, that run
the convolution through oneDNN: onednn_conv2d, and onednn_conv2d_bias, which adds the bias inside the convolution.
csrc/max_pool.cc adds max_pool2x2, the 2x2 max-pool of stride 2 that models.MaxPool2D runs in training, to the
bit F.max_pool2d's and faster than Paddle's CPU kernel (docs/performance.md). csrc/blocked.cc runs MiniGoogLeNet's
conv modules (convolution, batch norm, ReLU), 3x3 max-pools and concatenations on maps in oneDNN's layout blocked
by BLOCK channels (conv_bn_relu, max_pool_blocked, concat_blocked). The files build into one library, linked against
the libdnnl.so.3 that Paddle's CPU wheel already ships, with the oneDNN headers of the `onednn-devel-cpu-gomp`
package (requirements.txt).

    prepare(backend)   before the process group: build (or find) the operator; several workers on one machine
                       build it once, under a lock, and a damaged build is rebuilt. Never raises for "auto".
    activate(...)      after it: load the build, check it against Paddle's layers (check), and route Conv2D,
                       MaxPool2D and MiniGoogLeNet's training step through it
    runs(x)            whether the operator runs a convolution of x: active, float32, CPU, dygraph
    conv2d(...)        what models.Conv2D calls: the operator where it runs, else F.conv2d (so paddle.jit.save,
                       and with it Paddle Inference and ONNX, always get Paddle's)
    pools(x, ...)      whether max_pool2x2(x) runs models.MaxPool2D's pool of x
    blocks(x)          whether MiniGoogLeNet trains on x in the blocked layout (conv_bn_relu and the others)
    kept_plans()       how many plans the operators keep: a backward pass keeps its shape's, a few dozen per cache
                       at most; evaluation keeps none, and no plan holds a buffer past its call

--conv-backend auto (the default) uses the operator where it builds and passes the check, and Paddle's
convolution with one logged line saying why where it does not; onednn requires it (a run that cannot have it
stops with the reason); paddle never builds it.

Long because the build, the start-up check and the Python side of every operator are one contract with
the C++ in csrc/, kept in one place.
"""

from __future__ import annotations

import contextlib
import ctypes
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

import numpy as np
import paddle
import paddle.nn.functional as F

from paddle_mnist.datasets.datafiles import file_digest
from paddle_mnist.runtime import cpu

BACKENDS = ("auto", "onednn", "paddle")
CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("onednn_conv.cc", "blocked.cc", "max_pool.cc"))
INCLUDES = (CSRC / "onednn_common.h",)  # what the sources include from beside them
NAME = "onednn_conv"  # the library's name; its operators: onednn_conv2d(_bias), max_pool2x2 and the blocked ones
HEADERS_PACKAGE = "onednn-devel-cpu-gomp"
HEADERS_FIX = f"pip install {HEADERS_PACKAGE}==2023.2.0"
BUILD_TIMEOUT_S = 900
# float32 sums in another order: within 1e-4 of each value, or of the largest where values cancel to near 0
CHECK_RTOL, CHECK_ATOL = 1e-4, 1e-4
PLAN_CACHE_CAPACITY = 64  # plans each operator keeps (PlanCache::kCapacity in csrc/onednn_common.h)
PLAN_CACHES = 4  # the convolutions', the conv modules', the blocked max-pools' and the concatenations'
AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})  # what oneDNN's AVX-512 kernels need


def channel_block(flags: set[str] | frozenset[str], environ: dict | os._Environ = os.environ) -> int:
    """The channel block of the maps MiniGoogLeNet trains on: oneDNN's own for its convolution kernels, 16 with
    AVX-512, else 8 (docs/performance.md measures both). 8 also where ONEDNN_MAX_CPU_ISA holds oneDNN below AVX-512
    (AVX2 and older), as it holds its kernels (how a machine with AVX-512 runs the kernels of one without)."""
    isa = environ.get("ONEDNN_MAX_CPU_ISA", environ.get("DNNL_MAX_CPU_ISA", "")).upper()
    below_avx512 = isa.startswith(("SSE", "AVX2")) or isa == "AVX"
    return 16 if AVX512_CORE <= flags and not below_avx512 else 8


def _processor_flags() -> set[str]:
    try:
        return cpu.cpu_flags(Path("/proc/cpuinfo").read_text())[1]
    except OSError:
        return set()


BLOCK = channel_block(_processor_flags())

# Run in a child process, so that a compiler or loader failure cannot take the trainer down with it:
# paddle.utils.cpp_extension.load compiles with Paddle's own headers and flags, then loads the result once.
BUILD_SCRIPT = """
import ctypes, os, sys
from paddle.utils import cpp_extension
sources, out, include, libs, package_parent = sys.argv[1:6]
module = cpp_extension.load(
    name="onednn_conv", sources=sources.split(os.pathsep), extra_include_paths=[include],
    extra_cxx_cflags=["-O3", "-std=c++17"],
    extra_ldflags=[f"-L{libs}", "-l:libdnnl.so.3", f"-Wl,-rpath,{libs}"],
    build_directory=out,
)
# every symbol resolved now (a missing one would otherwise end the trainer at its first call), then the check
ctypes.CDLL(os.path.join(out, "onednn_conv", "onednn_conv.so"), mode=os.RTLD_NOW)
sys.path.insert(0, package_parent)
from paddle_mnist.ops import onednn
onednn.check(module)
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


_ops = None  # the loaded operators' Python module, once active


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
    h = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + INCLUDES))
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
    cmd = [sys.executable, "-c", BUILD_SCRIPT, sources, str(folder), str(include), str(libs), package_parent]
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
        _say(f"building them for this machine into {folder}, once (a minute or more; later runs load them)")
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


def check(ops) -> None:
    """Both convolutions against F.conv2d on two small geometries (padded, strided and not), outputs and every
    gradient, the max-pool against F.max_pool2d (check_max_pool) and the blocked operators (check_blocked).
    Unavailable where they differ, or where a convolution ran on oneDNN's reference loops (right, and slow): such a
    build is not used."""
    rng = paddle.get_rng_state()
    try:
        paddle.seed(0)
        for stride, padding, side, kernel in ((1, 2, 9, 5), (2, 0, 10, 3)):
            x, w, b = paddle.randn([2, 3, side, side]), paddle.randn([4, 3, kernel, kernel]), paddle.randn([4])
            cases = (
                ("", lambda: ops.onednn_conv2d(x, w, stride, padding, True), None),  # noqa: B023 (called here)
                (" with a bias", lambda: ops.onednn_conv2d_bias(x, w, b, stride, padding, True), b),  # noqa: B023
            )
            for which, ours, bias in cases:
                got = _output_and_grads(ours, x, w, bias)
                want = _output_and_grads(lambda: F.conv2d(x, w, bias, stride, padding), x, w, bias)  # noqa: B023
                names = ("output", "input gradient", "weight gradient", "bias gradient")
                for name, a, e in zip(names, got, want):
                    if a.shape != e.shape or not np.allclose(a, e, rtol=CHECK_RTOL, atol=CHECK_ATOL * np.abs(e).max()):
                        raise Unavailable(
                            f"its {name} differs from F.conv2d's{which} (stride {stride}, padding {padding})"
                        )
        check_max_pool(ops)
        check_blocked(ops)
        if slow := reference_kernels(ops):
            raise Unavailable(
                f"oneDNN has only its reference loops, which go element by element, for {slow} of the checked "
                "convolutions on this processor (no JIT kernel for their layouts): Paddle's run faster"
            )
    finally:
        paddle.set_rng_state(rng)


def check_max_pool(ops) -> None:
    """max_pool2x2 against F.max_pool2d, to the bit, outputs and input gradients: ties, NaN, infinities and a
    window of -inf, on maps with even and odd sides, and rows of fewer than 4 outputs and of a number not a
    multiple of 4."""
    for shape in ([2, 3, 9, 9], [2, 3, 7, 6], [1, 2, 14, 15]):
        x = paddle.round(paddle.randn(shape) * 2) / 2  # halves: many windows hold their maximum twice
        x[0, 0, 0, 0], x[0, 1, 4, 4], x[-1, -1, -1, -2] = float("nan"), float("inf"), float("nan")
        x[0, 0, 2:4, 2:4] = float("-inf")
        got = _output_and_grads(lambda: ops.max_pool2x2(x)[0], x)  # noqa: B023 (called here)
        want = _output_and_grads(lambda: F.max_pool2d(x, 2, 2), x)  # noqa: B023
        for name, a, e in zip(("output", "input gradient"), got, want):
            if a.shape != e.shape or not np.array_equal(a, e, equal_nan=True):
                raise Unavailable(f"its max-pool {name} differs from F.max_pool2d's (a {shape[2]}x{shape[3]} map)")


def check_blocked(ops) -> None:
    """The blocked operators (csrc/blocked.cc) against Paddle's layers: a conv module on an NCHW image and on a
    blocked map (3x3, stride 2, unpadded: oneDNN's right padding is then negative), outputs, every gradient and the
    running statistics in training, outputs in evaluation; the concatenation of two blocked maps, to the bit; and
    the 3x3 max-pool of stride 2 on a map of odd side."""
    from paddle import nn

    image, blocked_map = paddle.randn([2, 3, 9, 9]), paddle.randn([2, 32 // BLOCK, 9, 9, BLOCK])
    for x, stride, padding in ((image, 1, 1), (blocked_map, 2, 0)):
        with paddle.utils.unique_name.guard():  # names of their own: the model's parameters, built later, keep theirs
            conv, norm = nn.Conv2D(_channels(x), 32, 3, stride=stride, padding=padding), nn.BatchNorm2D(32)
        conv.geometry = {"stride": stride, "padding": padding}
        norm.weight.set_value(paddle.rand([32]) + 0.5)
        norm.bias.set_value(paddle.randn([32]))
        params = (conv.weight, conv.bias, norm.weight, norm.bias)
        ours = _output_and_grads(lambda: unblock(conv_bn_relu(x, conv, norm, ops)), x, *params)  # noqa: B023
        ours += [norm._mean.numpy(), norm._variance.numpy()]
        norm._mean.set_value(paddle.zeros([32]))
        norm._variance.set_value(paddle.ones([32]))
        want = _output_and_grads(lambda: F.relu(norm(conv(unblock(x) if x.ndim == 5 else x))), x, *params)  # noqa: B023
        want += [norm._mean.numpy(), norm._variance.numpy()]
        names = ("output", "input", "weight", "bias", "scale", "shift", "running mean", "running variance")
        for name, a, e in zip(names, ours, want):
            # the convolution's bias gradient is 0 but for rounding (batch norm subtracts the mean): compared to 1
            if a.shape != e.shape or not np.allclose(a, e, rtol=CHECK_RTOL, atol=CHECK_ATOL * max(np.abs(e).max(), 1)):
                raise Unavailable(f"its conv module's {name} differs from Paddle's layers' (stride {stride})")
        norm._mean.set_value(paddle.randn([32]))
        norm._variance.set_value(paddle.rand([32]) + 0.5)
        norm.eval()
        with paddle.no_grad():
            got = unblock(conv_relu_folded(x, conv, norm, ops)).numpy()
            expected = F.relu(norm(conv(unblock(x) if x.ndim == 5 else x))).numpy()
        if got.shape != expected.shape or not np.allclose(got, expected, rtol=CHECK_RTOL, atol=CHECK_ATOL):
            raise Unavailable(f"its conv module in evaluation differs from Paddle's layers' (stride {stride})")
    other = paddle.randn([2, 1, 9, 9, BLOCK])
    got = _output_and_grads(lambda: unblock(concat_blocked(blocked_map, other, ops)), blocked_map, other)
    want = _output_and_grads(lambda: paddle.concat([unblock(blocked_map), unblock(other)], axis=1), blocked_map, other)
    if any(a.shape != e.shape or not np.array_equal(a, e) for a, e in zip(got, want)):
        raise Unavailable("its blocked concatenation differs from paddle.concat's")
    got = _output_and_grads(lambda: unblock(max_pool_blocked(blocked_map, 3, 2, ops)), blocked_map)
    want = _output_and_grads(lambda: F.max_pool2d(unblock(blocked_map), 3, 2), blocked_map)
    for name, a, e in zip(("output", "input gradient"), got, want):
        if a.shape != e.shape or not np.allclose(a, e, rtol=CHECK_RTOL, atol=CHECK_ATOL * np.abs(e).max()):
            raise Unavailable(f"its blocked max-pool {name} differs from F.max_pool2d's")


def _channels(x: paddle.Tensor) -> int:
    return x.shape[1] * x.shape[4] if x.ndim == 5 else x.shape[1]


def _output_and_grads(run, *inputs: paddle.Tensor | None) -> list[np.ndarray]:
    """run()'s output and the gradients of sum(output * cos(output)) for each of the inputs given (None: left out):
    a loss whose gradient differs from place to place."""
    inputs = [t for t in inputs if t is not None]
    for t in inputs:
        t.stop_gradient = False
    y = run()
    (y * paddle.cos(y)).sum().backward()
    grads = [t.grad.numpy() for t in inputs]
    for t in inputs:
        t.clear_gradient()
    return [y.numpy(), *grads]


def activate(prepared: Prepared, device: str) -> str:
    """Load and check the prepared build and route Conv2D through it; the line the log gets about it. Raises
    Unavailable where the user asked for oneDNN and cannot have it."""
    global _ops
    _ops = None
    if prepared.library is None:
        return f"convolutions: Paddle's ({prepared.reason})"
    if device != "cpu":
        if prepared.backend == "onednn":
            raise Unavailable(f"--conv-backend onednn runs on the CPU; this run's device is {device}")
        return f"convolutions: Paddle's (device {device})"
    try:
        ops = load(prepared.library)
        check(ops)
    except Unavailable as e:
        if prepared.backend == "onednn":
            raise
        return f"convolutions: Paddle's (oneDNN's operator from {prepared.library} was not used: {e})"
    except Exception as e:  # a library that loads but fails: Paddle's message, on one line
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        if prepared.backend == "onednn":
            raise Unavailable(f"oneDNN's operator from {prepared.library} failed to load: {reason}") from None
        return f"convolutions: Paddle's (oneDNN's operator from {prepared.library} failed to load: {reason})"
    _ops = ops
    how = f"built in {prepared.built_s:.0f} s" if prepared.built_s is not None else "built before"
    return f"convolutions: oneDNN (custom operator, {how}: {prepared.library})"


def deactivate() -> None:
    global _ops
    _ops = None


def active() -> bool:
    return _ops is not None


@contextlib.contextmanager
def plain_layers():
    """Paddle's own layers for every network run inside, the operators set aside for the while: for what must see
    each layer run (the model summary's hooks), where evaluation would otherwise run blocked."""
    global _ops
    kept, _ops = _ops, None
    try:
        yield
    finally:
        _ops = kept


@paddle.jit.not_to_static  # run as it is while paddle.jit.save traces the network: False there
def runs(x: paddle.Tensor) -> bool:
    """Whether conv2d(x, ...) runs by oneDNN: the operator is active and x is a float32 CPU tensor in dygraph."""
    return _ops is not None and x.dtype == paddle.float32 and paddle.in_dynamic_mode() and x.place.is_cpu_place()


@paddle.jit.not_to_static  # run as it is while paddle.jit.save traces the network: it then takes F.conv2d
def conv2d(
    x: paddle.Tensor, weight: paddle.Tensor, stride: int, padding: int, bias: paddle.Tensor | None = None
) -> paddle.Tensor:
    """F.conv2d(x, weight, bias, stride, padding), by oneDNN where it runs (runs(x))."""
    if runs(x):
        if bias is None:
            return _ops.onednn_conv2d(x, weight, stride, padding, not x.stop_gradient)
        return _ops.onednn_conv2d_bias(x, weight, bias, stride, padding, not x.stop_gradient)
    return F.conv2d(x, weight, bias, stride=stride, padding=padding)


@paddle.jit.not_to_static
def conv2d_grad64(
    x: paddle.Tensor, weight: paddle.Tensor, grad_out: paddle.Tensor, stride: int, padding: int, bias: bool
) -> list[paddle.Tensor]:
    """conv2d's backward pass where runs(x): the input's gradient in float32, the weights' (and the bias's) summed
    over the batch in float64 (exact.py adds them up over micro-batches and workers before it rounds them)."""
    op = _ops.onednn_conv2d_bias_grad64 if bias else _ops.onednn_conv2d_grad64
    return op(x, weight, grad_out, stride, padding, not x.stop_gradient)


def pools(x: paddle.Tensor, kernel: int, stride: int, padding: int, ceil_mode: bool) -> bool:
    """Whether max_pool2x2(x) computes F.max_pool2d(x, kernel, stride, padding, ceil_mode): a 2x2 window of stride
    2 without padding, in floor mode, where the operator runs (runs(x))."""
    return kernel == 2 and stride == 2 and padding == 0 and not ceil_mode and runs(x)


@paddle.jit.not_to_static
def max_pool2x2(x: paddle.Tensor) -> paddle.Tensor:
    """F.max_pool2d(x, 2, 2) by the operator of csrc/max_pool.cc; for where pools(x, ...) holds."""
    return _ops.max_pool2x2(x)[0]


def blocks(x: paddle.Tensor) -> bool:
    """Whether conv_bn_relu, max_pool_blocked and concat_blocked run on x: where the operators run (runs(x)).
    MiniGoogLeNet then trains in oneDNN's layout blocked by BLOCK channels (csrc/blocked.cc)."""
    return runs(x)


def blocks_now(layer: paddle.nn.Layer, x: paddle.Tensor) -> bool:
    """Whether a network of conv modules runs x blocked: in training (conv_bn_relu), and in evaluation without
    gradients (conv_relu_folded), where the operators run (blocks(x))."""
    return blocks(x) and (layer.training or not paddle.is_grad_enabled())


@paddle.jit.not_to_static
def conv_bn_relu(
    x: paddle.Tensor, conv: paddle.nn.Conv2D, norm: paddle.nn.BatchNorm2D, ops=None, block: int | None = None
) -> paddle.Tensor:
    """relu(norm(conv(x))) in training, by oneDNN: x NCHW or blocked [N, C/B, H, W, B], the output blocked by B
    channels: x's block where it is blocked, else `block` (BLOCK when None).

    The batch norm normalises by the batch's mean and biased variance, and its running averages move as Paddle's
    do: running = momentum * running + (1 - momentum) * batch. conv is a models.Conv2D (its geometry); ops, the
    operators' module where it is not the active one (check).
    """
    stride, padding = conv.geometry["stride"], conv.geometry["padding"]
    out, _, mean, variance = (ops or _ops).onednn_conv_bn_relu(
        x,
        conv.weight,
        conv.bias,
        norm.weight,
        norm.bias,
        stride,
        padding,
        norm._epsilon,
        not x.stop_gradient,
        x.shape[4] if x.ndim == 5 else block or BLOCK,
    )
    with paddle.no_grad():
        m = norm._momentum
        paddle.assign(norm._mean * m + mean * (1 - m), norm._mean)
        paddle.assign(norm._variance * m + variance * (1 - m), norm._variance)
    return out


@paddle.jit.not_to_static
def conv_relu_folded(
    x: paddle.Tensor, conv: paddle.nn.Conv2D, norm: paddle.nn.BatchNorm2D, ops=None, block: int | None = None
) -> paddle.Tensor:
    """relu(norm(conv(x))) in evaluation, by oneDNN: batch norm by its running statistics, folded into the
    convolution's weights and bias, ReLU as the convolution's post-op; x NCHW or blocked, the output blocked as
    conv_bn_relu's. No gradient: for where paddle.no_grad() holds (blocks_now)."""
    scale = norm.weight / paddle.sqrt(norm._variance + norm._epsilon)
    weight = conv.weight * scale.reshape([-1, 1, 1, 1])
    bias = (conv.bias - norm._mean) * scale + norm.bias
    stride, padding = conv.geometry["stride"], conv.geometry["padding"]
    block = x.shape[4] if x.ndim == 5 else block or BLOCK
    return (ops or _ops).onednn_conv_relu_blocked(x, weight, bias, stride, padding, block)


@paddle.jit.not_to_static
def max_pool_blocked(x: paddle.Tensor, kernel: int, stride: int, ops=None) -> paddle.Tensor:
    """F.max_pool2d(x, kernel, stride) of a blocked map [N, C/B, H, W, B] (no padding, floor mode), by oneDNN."""
    return (ops or _ops).onednn_max_pool_blocked(x, kernel, stride)[0]


@paddle.jit.not_to_static
def concat_blocked(a: paddle.Tensor, b: paddle.Tensor, ops=None) -> paddle.Tensor:
    """paddle.concat([a, b], axis=1) of two blocked maps, by oneDNN on every thread (Paddle's copies on one), and
    its gradient split in place from the output's."""
    return (ops or _ops).onednn_concat_blocked(a, b)


def _count(counter) -> int:
    """The value of one of the operators' counters (its input is not read; a custom operator takes one)."""
    return int(counter(paddle.zeros([1])).numpy()[0])


def kept_plans(ops=None) -> int:
    """How many plans (primitives made for one shape) the operators' caches keep, all together. Only backward
    passes keep one, and each cache keeps at most PLAN_CACHE_CAPACITY (csrc/onednn_common.h's PlanCache)."""
    return _count((ops or _ops).onednn_kept_plans)


def reference_kernels(ops=None) -> int:
    """How many convolution primitives this process made on oneDNN's reference loops (note_kernel in
    csrc/onednn_common.h): check() refuses a build that makes any."""
    return _count((ops or _ops).onednn_reference_kernels)


def unblock(x: paddle.Tensor) -> paddle.Tensor:
    """A blocked map [N, C/B, H, W, B] as NCHW (for tests and checks; the network itself never needs it)."""
    n, cb, h, w, b = x.shape
    return x.transpose([0, 1, 4, 2, 3]).reshape([n, cb * b, h, w])


OPENMP_RUNTIMES = ("libgomp.so.1", "libiomp5.so")  # oneDNN's (GNU) and MKL's (Intel) in Paddle's CPU wheels


def set_openmp_threads(n: int) -> dict[str, int]:
    """omp_set_num_threads(n) in every OpenMP runtime this process has loaded; {runtime: its threads now}.

    Paddle's set_num_threads reaches one runtime, and its CPU wheel loads two: MKL's Intel OpenMP and the GNU
    OpenMP its libdnnl.so.3 (and so this operator) runs on. Left alone, the second would run as many threads as
    the machine has cores in every worker.
    """
    seen = {}
    for name in OPENMP_RUNTIMES:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:  # not loaded in this process
            continue
        lib.omp_set_num_threads(ctypes.c_int(n))
        seen[name] = lib.omp_get_max_threads()
    return seen
