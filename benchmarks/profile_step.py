"""Where one training step's time goes: paddle.profiler over a few steps of one model, operators by CPU time.

    python scripts/profile_step.py --model mnist_cnn                 # the trainer's network, as the trainer runs it
    python scripts/profile_step.py --model mnist_cnn --plain --no-mkl-setting   # the tutorial's layers, MKL as is

The step is the trainer's: forward, cross-entropy, backward, Momentum with L2 decay, clear_grad, on random
batches of the dataset's shape, in one process with --threads math threads. --plain runs nn.Conv2D layers as the
tutorial writes them (MnistCNN(plain=True); for the other models every Conv2D through nn.Conv2D's own forward).
--no-mkl-setting leaves MKL's kernel choice as it is, instead of the trainer's (paddle_mnist/cpu.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paddle_mnist import cpu  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mnist_cnn", choices=["mnist_cnn", "mnist_cnn_bn", "cifar_cnn", "minigooglenet"])
    p.add_argument("--plain", action="store_true", help="the tutorial's layers, one after another")
    p.add_argument("--no-mkl-setting", action="store_true", help="leave MKL's kernel choice alone")
    p.add_argument("--batch", type=int, default=64, help="images per step")
    p.add_argument("--steps", type=int, default=20, help="profiled steps, after 5 warm-up steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=12, help="operators listed")
    args = p.parse_args()
    if not args.no_mkl_setting:
        cpu.prefer_fast_kernels()
    import paddle  # after the MKL setting, which MKL reads at its first call
    import paddle.nn.functional as F
    import paddle.profiler as profiler

    from paddle_mnist import models

    paddle.base.core.set_num_threads(args.threads)
    paddle.seed(0)
    shape = (1, 28, 28) if args.model.startswith("mnist") else (3, 32, 32)
    if args.plain and args.model == "mnist_cnn":
        net = models.MnistCNN(plain=True)
    else:
        net = models.build_model(args.model, 10, shape)
        for layer in net.sublayers() if args.plain else []:
            if isinstance(layer, models.Conv2D):
                layer.forward = types.MethodType(paddle.nn.Conv2D.forward, layer)
    opt = paddle.optimizer.Momentum(
        0.05, momentum=0.9, parameters=net.parameters(), weight_decay=paddle.regularizer.L2Decay(5e-4)
    )
    xs = [paddle.randn([args.batch, *shape]) for _ in range(4)]
    ys = [paddle.randint(0, 10, [args.batch]) for _ in range(4)]

    def step(i: int) -> None:
        F.cross_entropy(net(xs[i % 4]), ys[i % 4]).backward()
        opt.step()
        opt.clear_grad()

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
        f"{args.model}{' (plain layers)' if args.plain else ''}, batch {args.batch}, {args.threads} thread(s), "
        f"{cpu.MKL_CODE_PATH}={mkl}: {rate:.0f} images/s unprofiled"
    )
    prof.summary(sorted_by=profiler.SortedKeys.CPUTotal, op_detail=False, thread_sep=False, time_unit="ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
