"""The faster network is the same network: outputs, gradients and weights files equal to the tutorial's layers."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from helpers import launch_env
from paddle import nn

from paddle_mnist.network.models import Conv2D, MaxPool2D, MnistCNN, build_model
from paddle_mnist.ops import fastpath
from paddle_mnist.runtime import cpu


def outputs_and_grads(net: nn.Layer, x: paddle.Tensor, y: paddle.Tensor, seed: int = 3):
    net.clear_gradients()
    paddle.seed(seed)  # the same dropout masks for both networks
    logits = net(x)
    F.cross_entropy(logits, y).backward()
    return logits.numpy(), {name: p.grad.numpy() for name, p in net.named_parameters() if p.grad is not None}


def test_mnist_cnn_matches_the_tutorial_layers_forward_and_backward():
    paddle.seed(11)
    fast = MnistCNN()
    plain = MnistCNN(plain=True)  # nn.Conv2D, ReLU, MaxPool2D, one after another, as the tutorial writes them
    plain.set_state_dict(fast.state_dict())  # the same names: the weights load into either
    assert {type(layer) for layer in plain.features} == {nn.Conv2D, nn.ReLU, nn.MaxPool2D}
    x, y = paddle.randn([16, 1, 28, 28]), paddle.randint(0, 10, [16])
    out_fast, grads_fast = outputs_and_grads(fast, x, y)
    out_plain, grads_plain = outputs_and_grads(plain, x, y)
    np.testing.assert_array_equal(out_fast, out_plain)  # max and ReLU commute with the bias add, to the bit
    assert grads_fast.keys() == grads_plain.keys() and len(grads_fast) == 6
    for name in grads_fast:  # the bias gradients are summed in another order: equal to rounding
        np.testing.assert_allclose(grads_fast[name], grads_plain[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("hidden", [0, 256], ids=["mnist_cnn_bn", "mnist_cnn_bn_fc"])
def test_batch_norm_models_pool_before_relu_to_the_bit(hidden):
    """ReLU after the pool and the pool that keeps its argmax: outputs and every gradient equal to the tutorial's
    order and nn.MaxPool2D's, exactly (no bias is moved, so no sum changes order)."""
    paddle.seed(13)
    fast = MnistCNN(batch_norm=True, hidden=hidden)
    plain = MnistCNN(batch_norm=True, hidden=hidden, plain=True)
    plain.set_state_dict(fast.state_dict())
    assert MaxPool2D not in {type(layer) for layer in plain.sublayers()}
    x, y = paddle.randn([16, 1, 28, 28]), paddle.randint(0, 10, [16])
    out_fast, grads_fast = outputs_and_grads(fast, x, y)
    out_plain, grads_plain = outputs_and_grads(plain, x, y)
    np.testing.assert_array_equal(out_fast, out_plain)
    assert grads_fast.keys() == grads_plain.keys() and len(grads_fast) == (10 if hidden else 8)
    for name in grads_fast:
        np.testing.assert_array_equal(grads_fast[name], grads_plain[name], err_msg=name)


@pytest.mark.parametrize(("kernel", "stride", "side"), [(2, 2, 12), (3, 2, 15), (2, 2, 13)])
def test_max_pool_with_mask_routes_gradients_as_nn_max_pool2d_even_on_ties(kernel, stride, side):
    """Whole numbers, so most windows hold their maximum twice or more: the gradient still goes to the same input."""
    rng = np.random.default_rng(kernel * side)
    x = paddle.to_tensor(np.round(rng.normal(size=(4, 3, side, side))).astype("float32"), stop_gradient=False)
    results = []
    for pool in (MaxPool2D(kernel, stride), nn.MaxPool2D(kernel, stride)):
        out = pool(x)
        (out * paddle.arange(out.size, dtype="float32").reshape(out.shape)).sum().backward()
        results.append((out.numpy(), x.grad.numpy().copy()))
        x.clear_gradient()
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    pool = MaxPool2D(kernel, stride)
    pool.eval()  # evaluation, and so the exported model, runs nn.MaxPool2D's own forward
    np.testing.assert_array_equal(pool(x).numpy(), results[1][0])


@pytest.mark.parametrize("fill", [float("nan"), float("-inf")])
def test_max_pool_with_mask_takes_windows_without_a_number_as_nn_max_pool2d(fill):
    """A diverged step's NaN or -inf windows have no argmax (-1): the layer then gives nn.MaxPool2D's output and
    gradient instead of letting Paddle's backward write outside the tensor."""
    x = np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype("float32")
    x[0, 0, :2, :2] = fill  # the first window, whose -1 would land before the buffer
    x[1, 2] = fill
    results = []
    for pool in (MaxPool2D(2, 2), nn.MaxPool2D(2, 2)):
        t = paddle.to_tensor(x, stop_gradient=False)
        out = pool(t)
        (out * paddle.arange(out.size, dtype="float32").reshape(out.shape)).sum().backward()
        results.append((out.numpy(), t.grad.numpy()))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("name", ["cifar_cnn", "minigooglenet", "cifar_fast"])
def test_conv_with_bias_added_by_rows_matches_nn_conv2d(name):
    """Every Conv2D and MaxPool2D of these models, run through nn.Conv2D's and nn.MaxPool2D's own forward instead,
    gives the same training step."""
    paddle.seed(12)
    fast = build_model(name, 10, (3, 32, 32))
    plain = build_model(name, 10, (3, 32, 32))
    plain.set_state_dict(fast.state_dict())
    convs = [layer for layer in plain.sublayers() if isinstance(layer, Conv2D)]
    assert convs and all(conv.bias is not None for conv in convs)
    for conv in convs:
        conv.forward = types.MethodType(nn.Conv2D.forward, conv)
    pools = [layer for layer in plain.sublayers() if isinstance(layer, MaxPool2D)]
    assert pools
    for pool in pools:
        pool.forward = types.MethodType(nn.MaxPool2D.forward, pool)
    x, y = paddle.randn([4, 3, 32, 32]), paddle.randint(0, 10, [4])
    out_fast, grads_fast = outputs_and_grads(fast, x, y)
    out_plain, grads_plain = outputs_and_grads(plain, x, y)
    np.testing.assert_array_equal(out_fast, out_plain)
    for key in grads_fast:
        np.testing.assert_allclose(grads_fast[key], grads_plain[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_add_channel_bias_adds_each_channel_its_own_value():
    x = paddle.zeros([2, 3, 4, 5])
    out = fastpath.add_channel_bias(x, paddle.to_tensor([1.0, 2.0, 3.0])).numpy()
    assert out.shape == (2, 3, 4, 5)
    for c, value in enumerate([1.0, 2.0, 3.0]):
        assert (out[:, c] == value).all()


AMD = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"
INTEL = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 fma avx512f\n"
OLD_AMD = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx\n"


def test_mkl_avx2_path_only_for_amd_processors_that_have_avx2_and_fma():
    assert cpu.mkl_settings(AMD, {}) == {"MKL_DEBUG_CPU_TYPE": "5"}
    assert cpu.mkl_settings(INTEL, {}) == {}  # MKL already picks its best kernels on Intel processors
    assert cpu.mkl_settings(OLD_AMD, {}) == {}  # the AVX2 kernels would crash there
    assert cpu.mkl_settings(AMD, {"MKL_DEBUG_CPU_TYPE": "4"}) == {}  # the user's own choice stands


# A process that does what the trainer's entry point does first, then reports the setting as MKL reads it (the C
# library's getenv, at MKL's first call) and as a process it starts afterwards inherits it
SEES_MKL_SETTING = """
import ctypes, subprocess, sys
from paddle_mnist.runtime import cpu
cpu.prefer_fast_kernels()
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
seen = libc.getenv(b"MKL_DEBUG_CPU_TYPE")
print(seen.decode() if seen else None)
sys.stdout.flush()
subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('MKL_DEBUG_CPU_TYPE'))"], check=True)
"""


def this_machine_wants_avx2() -> bool:
    """What docs/performance.md states: an AMD processor with AVX2 and FMA."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    vendor = next(line.split(":")[1].strip() for line in lines if line.startswith("vendor_id"))
    flags = set(next(line.split(":")[1] for line in lines if line.startswith("flags")).split())
    return vendor == "AuthenticAMD" and {"avx2", "fma"} <= flags


@pytest.mark.parametrize("users", [None, "4"], ids=["unset", "set-by-the-user"])
def test_the_process_and_its_children_get_the_setting(users):
    env = launch_env()
    env.pop("MKL_DEBUG_CPU_TYPE", None)
    if users:
        env["MKL_DEBUG_CPU_TYPE"] = users
    proc = subprocess.run([sys.executable, "-c", SEES_MKL_SETTING], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    want = users or ("5" if this_machine_wants_avx2() else "None")
    assert proc.stdout.split() == [want, want], proc.stdout  # MKL's view, then a child process's


MAPPED_BLOCKS = """
import ctypes, sys
from paddle_mnist.runtime import cpu
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
set_here = cpu.steady_malloc() if sys.argv[1] == "steady" else False
before = libc.mallinfo2().hblks
block = libc.malloc(8 << 20)
print(set_here, libc.mallinfo2().hblks - before)
"""


def mapped_blocks(mode: str, **env: str) -> tuple[str, str]:
    """In a fresh process: whether steady_malloc set anything, and how many fresh mappings an 8 MiB malloc took."""
    proc = subprocess.run(
        [sys.executable, "-c", MAPPED_BLOCKS, mode], env=launch_env() | env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return tuple(proc.stdout.split())


def test_steady_malloc_serves_step_sized_buffers_from_the_heap():
    """glibc's own count of mapped blocks: an 8 MiB allocation is a fresh mapping at glibc's starting threshold
    (128 KiB) and comes from the heap once steady_malloc fixed it at 32 MiB; a threshold the user set is kept."""
    try:
        ldd = subprocess.run(["ldd", "--version"], capture_output=True, text=True).stdout
    except OSError:
        ldd = ""
    if "GLIBC" not in ldd.upper() and "GNU" not in ldd.upper():
        pytest.skip("steady_malloc sets glibc's thresholds; this machine's C library is not glibc")
    assert mapped_blocks("default") == ("False", "1")
    assert mapped_blocks("steady") == ("True", "0")
    assert mapped_blocks("steady", MALLOC_MMAP_THRESHOLD_="131072") == ("False", "1")


def test_openmp_threads_reach_both_runtimes():
    """Paddle's CPU wheel loads MKL's Intel OpenMP and the GNU OpenMP its libdnnl.so.3 runs on: the trainer's
    thread count is set in both, at 1 and at 2, in a fresh process."""
    code = "import json, paddle; from paddle_mnist.runtime import cpu; "
    code += "print(json.dumps([cpu.set_openmp_threads(n) for n in (1, 2)]))"
    proc = subprocess.run([sys.executable, "-c", code], env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == [{"libgomp.so.1": 1, "libiomp5.so": 1}, {"libgomp.so.1": 2, "libiomp5.so": 2}]
