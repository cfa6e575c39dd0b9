"""The 2x2 max-pool of stride 2, forward and backward: the max_pool2x2 operator against Paddle's kernel that keeps
the argmax, which the trainer ran before (one process, one thread, as the trainer sets threads and malloc).

    python -m scripts.bench_pool

The maps are mnist_cnn's two, at batch 64. Each figure is the median over 7 repeats of the mean of 20 calls, in
milliseconds; the backward figure is the gradient alone (the input's gradient written afresh, nothing
accumulated). The operator is built or found as the trainer does (paddle_mnist/ops/onednn.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from paddle_mnist.runtime import cpu

cpu.prefer_fast_kernels()  # as the trainer runs
cpu.steady_malloc()

import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402

from paddle_mnist.ops import fastpath, onednn  # noqa: E402

SHAPES = ([64, 20, 28, 28], [64, 20, 14, 14])


def timed(call, repeats: int = 7, calls: int = 20) -> float:
    """The median over `repeats` of the mean time of `calls` calls, in ms."""
    call()
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(means)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    paddle.base.core.set_num_threads(1)
    cpu.set_openmp_threads(1)
    line = onednn.activate(onednn.prepare("onednn"), "cpu")
    print(line)
    kernels = {
        "max_pool2x2": lambda x: fastpath.max_pool2x2(x),
        "Paddle, with the argmax": lambda x: F.max_pool2d(x, 2, 2, return_mask=True)[0],
    }
    print(f"{'map':<16} {'kernel':<24} {'forward ms':>10} {'backward ms':>11}")
    for shape in SHAPES:
        x = paddle.randn(shape)
        x.stop_gradient = False
        for name, pool in kernels.items():
            y = pool(x)
            grad = paddle.ones_like(y)
            forward = timed(lambda: pool(x))  # noqa: B023 (called here)
            both = timed(lambda: paddle.grad([pool(x)], [x], [grad]))  # noqa: B023
            print(f"{'x'.join(map(str, shape)):<16} {name:<24} {forward:>10.3f} {both - forward:>11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
