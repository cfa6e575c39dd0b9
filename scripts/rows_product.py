"""What a dense layer's product costs on the exact path (network/exact.py's by_rows), in ms, median of --rounds:

    python -m scripts.rows_product
    python -m scripts.rows_product --shapes 2304x512,1600x512,980x10 --rows 8,16,32 --threads 1,2

For each weight shape (inputs x outputs; by default cifar_cnn's first dense layer on CIFAR-10's 32x32 images and
mnist_cnn's), 64 rows, each thread count: Paddle's one float32 product of all the rows
(what the float32 path runs, not the same bits in every batch), by_rows in Paddle's blocks (one thread, the path
without the oneDNN operators), and csrc/matmul.cc's blocks by oneDNN shared among the threads at each --rows (the
forward product, then the input's gradient's, x @ w and g @ w^T); then the exact backward pass (the input's
gradient, the weights' and the bias's in float64 and rounded) by Paddle's operators and by onednn_dense_backward.
The process takes the trainer's CPU settings (runtime/cpu.py) first.
"""

from __future__ import annotations

import argparse
import statistics
import time

from paddle_mnist.runtime import cpu


def timed(f, *args, rounds: int) -> float:
    """f(*args)'s median time over rounds calls, in ms, after one unrecorded call."""
    f(*args)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        f(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def paddles_backward(x, w, g):
    """The dense layer's exact backward pass as Paddle's operators ran it before onednn_dense_backward: the input's
    gradient by the rows product, the weights' and the bias's in float64, then rounded to float32."""
    import paddle

    from paddle_mnist.network import exact
    from paddle_mnist.ops import fastpath

    grad_x = fastpath.rows_matmul(g, w, True, exact.ROWS)
    wide = g.astype("float64")
    grad_w = paddle.matmul(x.astype("float64"), wide, transpose_x=True)
    grad_b = wide.sum(axis=0)
    return grad_x, grad_w, grad_b, grad_w.astype("float32"), grad_b.astype("float32")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="2304x512,980x10")
    parser.add_argument("--rows", default="8,16,32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    cpu.prefer_fast_kernels()
    cpu.steady_malloc()
    import paddle

    from paddle_mnist.network import exact
    from paddle_mnist.ops import fastpath, onednn

    paddle.set_device("cpu")
    prepared = onednn.prepare("onednn")
    if prepared.library is None:
        raise SystemExit(f"the oneDNN operators are not available here: {prepared.reason}")
    ops = onednn.load(prepared.library)
    rounds = args.rounds
    for threads in (int(t) for t in args.threads.split(",")):
        cpu.set_openmp_threads(threads)
        paddle.base.core.set_num_threads(threads)
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            x, w, g = paddle.randn([64, k]), paddle.randn([k, n]), paddle.randn([64, n])
            one = timed(paddle.matmul, x, w, rounds=rounds), timed(paddle.matmul, g, w, False, True, rounds=rounds)
            row = [f"{threads} thread(s), {k} by {n}: Paddle's one product {one[0]:.3f}, {one[1]:.3f};"]
            fastpath.use(None)
            blocks = timed(exact.by_rows, x, w, rounds=rounds), timed(exact.by_rows, g, w, True, rounds=rounds)
            row.append(f"Paddle's blocks of {exact.ROWS} {blocks[0]:.3f}, {blocks[1]:.3f};")
            fastpath.use(ops)
            for rows in (int(r) for r in args.rows.split(",")):
                forward = timed(fastpath.rows_matmul, x, w, False, rows, rounds=rounds)
                backward = timed(fastpath.rows_matmul, g, w, True, rows, rounds=rounds)
                row.append(f"oneDNN blocks of {rows} {forward:.3f}, {backward:.3f};")
            paddles = timed(paddles_backward, x, w, g, rounds=rounds)
            ours = timed(fastpath.dense_backward, x, w, g, True, exact.ROWS, rounds=rounds)
            row.append(f"the backward pass by Paddle's operators {paddles:.3f}, by onednn_dense_backward {ours:.3f}")
            print(" ".join(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
