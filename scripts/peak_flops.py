"""The processor's float32 ceiling as the trainer can reach it: a large matrix product (MKL's SGEMM through
paddle.matmul, with the trainer's MKL setting) on one thread, in one process and in one process per core at once.

    python -m scripts.peak_flops                 # 4096 x 4096 products, 5 timed, 1 and all cores
    python -m scripts.peak_flops --side 2048 --repeats 10

A training step's convolutions run at some fraction of this figure; docs/results.md compares cifar_fast's training
FLOPs per second with it. Prints GFLOP/s per process and their sum.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time


def one_core(side: int, repeats: int, start, results) -> None:
    from paddle_mnist.runtime import cpu

    cpu.prefer_fast_kernels()  # before Paddle loads MKL, as the trainer
    import paddle

    paddle.set_device("cpu")
    paddle.base.core.set_num_threads(1)
    a, b = paddle.randn([side, side]), paddle.randn([side, side])
    paddle.matmul(a, b).numpy()  # warm: MKL's first call picks its kernel
    start.wait()  # every process times the same span
    began = time.perf_counter()
    for _ in range(repeats):
        paddle.matmul(a, b).numpy()
    results.put(2 * side**3 * repeats / (time.perf_counter() - began) / 1e9)


def measure(processes: int, side: int, repeats: int) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=one_core, args=(side, repeats, start, results)) for _ in range(processes)]
    for p in procs:
        p.start()
    rates = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return sorted(rates)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", type=int, default=4096, help="the square matrices' side")
    p.add_argument("--repeats", type=int, default=5, help="timed products per process")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="processes at once in the second measurement")
    args = p.parse_args()
    for n in sorted({1, args.cores}):
        rates = measure(n, args.side, args.repeats)
        each = ", ".join(f"{r:.1f}" for r in rates)
        print(f"{n} process(es) x 1 thread, {args.side}x{args.side} SGEMM: {each} GFLOP/s; sum {sum(rates):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
