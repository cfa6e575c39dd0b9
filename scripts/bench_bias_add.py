"""The per-channel bias add of a convolution, forward and backward, in three layouts (one process, one thread).

    python -m scripts.bench_bias_add

(1, C, 1, 1) is how nn.Conv2D adds its bias; (C, 1) on an (N, C, H*W) view is what models.add_channel_bias does;
(C,) on an NHWC transpose is the channels-last alternative. Each figure is the median over 7 repeats of the mean
of 5 calls, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from paddle_mnist.runtime import cpu

cpu.prefer_fast_kernels()  # as the trainer runs

import paddle  # noqa: E402

SHAPES = ([64, 20, 14, 14], [64, 20, 28, 28], [64, 96, 32, 32])  # mnist_cnn's two maps, MiniGoogLeNet's first


def layouts(x: paddle.Tensor, b: paddle.Tensor) -> dict:
    n, c, h, w = x.shape
    return {
        "(1, C, 1, 1) broadcast": lambda: x + b.reshape([1, -1, 1, 1]),
        "(N, C, H*W) + (C, 1)": lambda: (x.reshape([n, c, h * w]) + b.reshape([c, 1])).reshape([n, c, h, w]),
        "NHWC + (C,)": lambda: x.transpose([0, 2, 3, 1]) + b,
    }


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    paddle.base.core.set_num_threads(1)
    print(f"{'shape':<18} {'layout':<24} {'forward ms':>10} {'backward ms':>11}")
    for shape in SHAPES:
        x = paddle.randn(shape)
        x.stop_gradient = False
        b = paddle.randn([shape[1]])
        b.stop_gradient = False
        for name, add in layouts(x, b).items():
            fwd, bwd = [], []
            for _ in range(7):
                t0 = time.perf_counter()
                ys = [add() for _ in range(5)]
                t1 = time.perf_counter()
                grad = paddle.ones_like(ys[0])
                for y in ys:
                    y.backward(grad)
                t2 = time.perf_counter()
                fwd.append((t1 - t0) / 5 * 1000)
                bwd.append((t2 - t1) / 5 * 1000)
                x.clear_gradient()
                b.clear_gradient()
            print(f"{str(shape):<18} {name:<24} {statistics.median(fwd):>10.2f} {statistics.median(bwd):>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
