"""Where one training step's time goes: paddle.profiler over a few steps of one model, operators by CPU time.

    python -m scripts.profile_step --model mnist_cnn                 # the trainer's network, as the trainer runs it
    python -m scripts.profile_step --model mnist_cnn --plain --no-mkl-setting   # the tutorial's layers, MKL as is
    python -m scripts.profile_step --model cifar_fast --eval --batch 1000          # evaluation's forward pass

The step is scripts/plain_loop.py's: forward, cross-entropy, backward, Momentum with L2 decay, clear_grad, on random
batches of the dataset's shape, in one process with --threads math threads. --plain runs nn.Conv2D layers as the
tutorial writes them (MnistCNN(plain=True); for the other models every Conv2D through nn.Conv2D's own forward).
--no-mkl-setting leaves MKL's kernel choice as it is, instead of the trainer's (paddle_mnist/runtime/cpu.py).
--eval times and profiles the evaluation's step instead: the network in eval mode, forward only, without gradients.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

from paddle_mnist.config import PER_WORKER_BATCH, Config
from paddle_mnist.runtime import cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=Config().model, help="a name of paddle_mnist.network.models.MODELS")
    p.add_argument("--plain", action="store_true", help="the tutorial's layers, one after another")
    p.add_argument("--no-mkl-setting", action="store_true", help="leave MKL's kernel choice alone")
    p.add_argument("--batch", type=int, default=PER_WORKER_BATCH, help="images per step")
    p.add_argument("--steps", type=int, default=20, help="profiled steps, after 5 warm-up steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--conv-backend", default="auto", choices=("auto", "onednn", "paddle"), help="as the trainer's flag")
    p.add_argument("--top", type=int, default=12, help="operators listed")
    p.add_argument("--eval", action="store_true", help="the evaluation's forward pass instead of a training step")
    args = p.parse_args()
    if not args.no_mkl_setting:
        cpu.prefer_fast_kernels()
    cpu.steady_malloc()  # as the trainer: its buffers from the heap, not mapped afresh every step
    import paddle  # after the MKL setting, which MKL reads at its first call
    import paddle.profiler as profiler

    from paddle_mnist.network import models
    from paddle_mnist.ops import onednn
    from scripts import plain_loop

    if args.model not in models.MODELS:
        p.error(f"--model: choose from {', '.join(models.MODELS)}")
    paddle.base.core.set_num_threads(args.threads)
    cpu.set_openmp_threads(args.threads)
    print(onednn.activate(onednn.prepare("paddle" if args.plain else args.conv_backend), "cpu"))
    paddle.seed(0)
    shape = plain_loop.image_shape(args.model)
    if args.plain and args.model == "mnist_cnn":
        net = models.MnistCNN(plain=True)
    else:
        net = models.build_model(args.model, 10, shape)
        for layer in net.sublayers() if args.plain else []:
            if isinstance(layer, models.Conv2D):
                layer.forward = types.MethodType(paddle.nn.Conv2D.forward, layer)
    opt = plain_loop.optimizer(net)
    xs = [paddle.randn([args.batch, *shape]) for _ in range(4)]
    ys = [paddle.randint(0, 10, [args.batch]) for _ in range(4)]

    def step(i: int) -> None:
        if args.eval:
            with paddle.no_grad():
                net(xs[i % 4])
        else:
            plain_loop.step(net, opt, xs[i % 4], ys[i % 4])

    if args.eval:
        net.eval()

    for i in range(5):
        step(i)
    t = time.perf_counter()
    for i in range(args.steps):
        step(i)
    rate = args.steps * args.batch / (time.perf_counter() - t)
    prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda p: None)  # no trace files
    prof.start()
    for i in range(args.steps):
        step(i)
        prof.step()
    prof.stop()
    mkl = os.environ.get(cpu.MKL_CODE_PATH, "unset")
    print(
        f"{args.model}{' (plain layers)' if args.plain else ''}{', evaluation' if args.eval else ''}, "
        f"batch {args.batch}, {args.threads} thread(s), "
        f"{'oneDNN' if onednn.active() else 'Paddle'} convolutions, "
        f"{cpu.MKL_CODE_PATH}={mkl}: {rate:.0f} images/s unprofiled"
    )
    prof.summary(sorted_by=profiler.SortedKeys.CPUTotal, op_detail=False, thread_sep=False, time_unit="ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
