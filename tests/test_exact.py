"""A step's gradient summed in float64 (paddle_mnist/network/exact.py): the same bits from a batch whole or in
parts, on oneDNN's AVX-512 and AVX2 kernels (and MKL's AVX2 code path), and only where every trained layer can
hand its gradient over."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from helpers import REPO, explain, launch_env

from paddle_mnist.network import exact, models
from paddle_mnist.runtime import cpu

# Run in a child process, so that oneDNN and MKL read the instruction set they are held to at their start. Prints
# one line per model: the largest difference of any parameter's gradient, whole batch against its parts.
WHOLE_AGAINST_PARTS = """
import sys
import numpy as np, paddle, paddle.nn.functional as F
from paddle_mnist.network import exact, models
from paddle_mnist.ops import onednn
line = onednn.activate(onednn.prepare("auto"), "cpu")
assert line.startswith("convolutions: oneDNN"), line

def gradients(model, x, y, parts, all_reduce=lambda t: None):
    model.clear_gradients()
    sums = exact.Sums()
    for xs, ys in zip(paddle.split(x, parts), paddle.split(y, parts)):
        with exact.summing(sums):
            (F.cross_entropy(model(xs), ys, reduction="none").sum() * (1.0 / len(y))).backward()
    sums.gradients(model.parameters(), all_reduce)
    return {p.name: p.grad.numpy().copy() for p in model.parameters()}

for name, shape in (("mnist_cnn", (1, 28, 28)), ("cifar_cnn", (3, 32, 32))):
    paddle.seed(1)
    model = models.build_model(name, 10, shape)
    for layer in model.sublayers():  # the masks are drawn by place in training; here the same for all: none
        if "Dropout" in type(layer).__name__:
            layer.eval()
    x, y = paddle.randn([96, *shape]), paddle.randint(0, 10, [96])
    whole = gradients(model, x, y, 1)
    for parts in ("alone", 2, 3):  # alone: one process's step, whose sums Sums.gradients leaves where autograd put them
        split = gradients(model, x, y, 1, None) if parts == "alone" else gradients(model, x, y, parts)
        gap = max(float(np.abs(whole[k] - split[k]).max()) for k in whole)
        print(name, parts, gap, len(whole))
"""


@pytest.mark.parametrize("isa", ["native", "AVX2"])
def test_a_batchs_gradient_is_the_same_bits_whole_and_in_parts(op, isa):
    """mnist_cnn's and cifar_cnn's gradients of 96 images, whole and in 2 and 3 parts summed as the trainer sums
    them, and whole as one process's step takes them (autograd's float32 rounding of each float64 sum, kept). With
    oneDNN's AVX2 kernels and MKL's AVX2 code path (those of an AMD EPYC), float32 sums of the same parts differed
    by 2e-6 of the gradient and Paddle's dense layer gave a row other bits in another batch."""
    env = launch_env() | ({"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"} if isa == "AVX2" else {})
    proc = subprocess.run(
        [sys.executable, "-c", WHOLE_AGAINST_PARTS], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, explain(proc)
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("mnist_cnn", "cifar_cnn"))]
    assert [(r[0], r[1], r[3]) for r in rows] == [
        ("mnist_cnn", "alone", "6"),
        ("mnist_cnn", "2", "6"),
        ("mnist_cnn", "3", "6"),
        ("cifar_cnn", "alone", "12"),
        ("cifar_cnn", "2", "12"),
        ("cifar_cnn", "3", "12"),
    ]
    assert all(float(r[2]) == 0.0 for r in rows), rows


def test_the_dense_layer_gives_each_row_the_same_bits_in_any_batch(op):
    """Its output and its input's gradient, row by row, from a batch of 96 and from slices of it of other sizes,
    starting at other places in a block of exact.ROWS rows (Paddle's own float32 product gives a row other bits in
    another batch: the last assertion)."""
    rng = np.random.default_rng(5)
    x = paddle.to_tensor(rng.standard_normal((96, 1600)).astype("float32"), stop_gradient=False)
    w = paddle.create_parameter([1600, 512], "float32")
    b = paddle.create_parameter([512], "float32")
    sums = exact.Sums()
    with exact.summing(sums):
        y = exact.linear(x, w, b)
        (y * y).sum().backward()
    wide = (x.numpy().astype(np.float64) @ w.numpy().astype(np.float64)) + b.numpy()
    np.testing.assert_allclose(y.numpy(), wide, rtol=1e-4, atol=1e-5)  # float32 sums of 1,600 products
    assert sums.by_param[id(w)][1].dtype == paddle.float64 and sums.by_param[id(b)][1].dtype == paddle.float64
    assert np.array_equal(w.grad.numpy(), sums.by_param[id(w)][1].numpy().astype(np.float32))
    np.testing.assert_allclose(w.grad.numpy(), x.numpy().T @ (2 * y.numpy()), rtol=1e-4, atol=1e-3)
    for rows in (slice(0, 1), slice(40, 72), slice(3, 20), slice(17, 96), slice(90, 95)):
        part = paddle.to_tensor(x.numpy()[rows], stop_gradient=False)
        with exact.summing(exact.Sums()):
            y_part = exact.linear(part, w, b)
            (y_part * y_part).sum().backward()
        assert np.array_equal(y_part.numpy(), y.numpy()[rows]), rows
        assert np.array_equal(part.grad.numpy(), x.grad.numpy()[rows]), rows
    plain = [paddle.matmul(t, w).numpy() for t in (x[3:20], x)]
    assert not np.array_equal(plain[0], plain[1][3:20])  # what the blocks of rows are for


def test_the_dense_layer_gives_the_same_bits_on_any_number_of_threads(op):
    """A worker of 1 thread and a process of 2 (as trainer.py sets them: Paddle's count, which MKL reads, and both
    OpenMP runtimes'): the same output and input gradient, on the models' dense shapes. Without exact.by_rows's one
    thread, MKL split the 980 by 10 and 980 by 256 layers' input gradient over 2 threads in another order."""
    rng = np.random.default_rng(3)
    got = {}
    try:
        for threads in (1, 2):
            paddle.base.core.set_num_threads(threads)
            cpu.set_openmp_threads(threads)
            for k, n in ((980, 10), (980, 256), (1600, 512)):
                w = paddle.to_tensor(rng.standard_normal((k, n)).astype("float32") * 0.05)
                x = paddle.to_tensor(rng.standard_normal((64, k)).astype("float32"))
                g = paddle.to_tensor(rng.standard_normal((64, n)).astype("float32"))
                got[threads, k, n] = (exact.by_rows(x, w).numpy(), exact.by_rows(g, w, transpose_y=True).numpy())
            rng = np.random.default_rng(3)
    finally:
        paddle.base.core.set_num_threads(1)
        cpu.set_openmp_threads(1)
    for k, n in ((980, 10), (980, 256), (1600, 512)):
        for one, two in zip(got[1, k, n], got[2, k, n]):
            assert np.array_equal(one, two), (k, n)


def test_outside_a_step_the_layers_are_paddles_own(op):
    """Without a Sums collecting, nothing goes through exact.py (evaluation, export, the models with batch norm)."""
    x = paddle.randn([4, 8])
    w, b = paddle.randn([8, 3]), paddle.randn([3])
    assert not exact.active()
    assert np.array_equal(exact.linear(x, w, b).numpy(), F.linear(x, w, b).numpy())
    with exact.summing(exact.Sums()), paddle.no_grad():
        assert not exact.active()  # nothing to hand over without gradients


def test_only_models_whose_every_trained_layer_hands_its_gradient_over_sum_exactly():
    shapes = {"cifar_cnn": (3, 32, 32), "cifar_fast": (3, 32, 32), "minigooglenet": (3, 32, 32)}
    for name, expected in [
        ("mnist_cnn", True),
        ("cifar_cnn", True),
        ("mnist_cnn_bn_fc", False),
        ("cifar_fast", False),
        ("minigooglenet", False),
    ]:
        model = models.build_model(name, 10, shapes.get(name, (1, 28, 28)))
        assert models.sums_exactly(model) is expected, name
    assert not models.sums_exactly(models.MnistCNN(plain=True))  # Paddle's own layers


def test_a_trained_parameter_without_a_float64_sum_is_refused(op):
    """A layer outside exact.py in a step that sums exactly would round its own way: the step stops, naming it."""
    model = models.build_model("mnist_cnn_bn_fc", 10, (1, 28, 28))
    sums = exact.Sums()
    with exact.summing(sums):
        F.cross_entropy(model(paddle.randn([8, 1, 28, 28])), paddle.randint(0, 10, [8])).backward()
    with pytest.raises(RuntimeError, match="no float64 gradient sum for the parameters"):
        sums.gradients(model.parameters(), lambda t: None)


# Run in a child process with the given OpenMP threads from its first call on (oneDNN reads them as it makes a
# primitive and as it runs one): the first layer's weight and bias gradients of 8 images (3 channels, 32x32).
FIRST_LAYER = """
import hashlib, sys
import numpy as np, paddle
from paddle_mnist.ops import fastpath, onednn
from paddle_mnist.runtime import cpu
line = onednn.activate(onednn.prepare("auto"), "cpu")
assert line.startswith("convolutions: oneDNN"), line
cpu.set_openmp_threads(int(sys.argv[1]))
rng = np.random.default_rng(0)
x = paddle.to_tensor(rng.standard_normal((8, 3, 32, 32)).astype("float32"))
w = paddle.to_tensor((rng.standard_normal((32, 3, 3, 3)) * 0.2).astype("float32"))
g = paddle.to_tensor(rng.standard_normal((8, 32, 32, 32)).astype("float32"))
_, grad_w, grad_b, *_ = fastpath.conv2d_grad64(x, w, g, 1, 1, bias=True)
print(hashlib.sha256(grad_w.numpy().tobytes() + grad_b.numpy().tobytes()).hexdigest())
"""


def test_an_images_weight_gradient_is_the_same_bits_on_any_number_of_threads(op):
    """One process on 2 threads trains what 2 workers of 1 thread train only if each image's weight gradient does
    not depend on the threads: oneDNN's kernel for a 3-channel first layer split it among 2 threads, and
    cifar_cnn on the CIFAR-10 copy ended 2.4e-3 from its workers after 15 steps (csrc/onednn_conv.cc runs it on one
    thread where exact.py sums, as here)."""
    digests = []
    for threads in (1, 2):
        proc = subprocess.run(
            [sys.executable, "-c", FIRST_LAYER, str(threads)],
            cwd=REPO,
            env=launch_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, explain(proc)
        digests.append(proc.stdout.split()[-1])
    assert digests[0] == digests[1]
