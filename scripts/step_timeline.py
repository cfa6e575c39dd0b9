"""Where a data-parallel step's time goes: every rank's steps timed phase by phase, with and without the meeting.

    python -m scripts.step_timeline                       # 2 workers, the default model, 300 steps a mode
    python -m scripts.step_timeline --workers 16 --steps 120

The trainer's step without its machinery (no logging, checkpoints or input pipeline: fixed batches of 64 images,
random values, the model built as the trainer builds it, oneDNN's operators, one thread a worker), run under
paddle.distributed.launch in these modes, one after another, the order reversed every other round:

    none       no collective: N independent processes side by side (the limit)
    pause      no collective, no meeting: each rank sleeps 1 ms after each backward pass, about what a rank of a
               lockstep job waits, so its core idles as a waiting core does, with the ranks' steps left unaligned
    lockstep   no collective either: after each backward pass the ranks meet over a plain socket (one byte to rank 0
               and one back, Meeting below), so every step waits for the slowest rank as a data-parallel step does,
               with nothing of Paddle's in the meeting: what any synchronous job pays on the machine
    barrier    a one-value all-reduce after each backward pass: the cost of meeting, with nothing to carry
    allreduce  the same meeting, then one all-reduce of all gradients flattened: meeting and carrying apart
    dataparallel  paddle.DataParallel with every gradient in one bucket, as the trainer runs with --cpu-sums gloo
    shared     paddle.DataParallel with the gradients averaged through shared memory after backward, as the trainer
               runs by default within one machine (runtime/local_sum.py; in the all-reduce column)
    overlap    tried and not adopted: each bucket of gradients (256 KB, in backward order) all-reduced on a thread
               of its own as soon as backward has made it, while backward goes on (GradientStream below)

Every rank records, for every step, when it started, ended its forward and backward passes, left the meeting, left
the all-reduce and ended the optimizer step (one clock for all processes: CLOCK_MONOTONIC). The table gives each
phase's median over ranks and steps (the first 20 steps left out), the global images/s and the share of the none
mode's rate. "wait" is the time from a rank's end of backward to the meeting's end: the slower rank's lead plus
the meeting's own latency. --json keeps every round's figures. Last, whether a rank's speed persists from one
window of steps to the next, which a batch split in proportion to the ranks' rates would need (persistence()).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scripts.bench_torch import PER_WORKER, REPO

MODES = ("none", "pause", "lockstep", "barrier", "allreduce", "dataparallel", "shared", "overlap")
SKIP = 20  # warm-up steps left out of the medians
WINDOW = 20  # steps a window of the persistence figures
PAUSE = 0.001  # s, the pause mode's idle time a step


def worker(args) -> None:
    """One rank: fixed batches through the model, each step's marks written to args.out/RANK.json."""
    from paddle_mnist.runtime import cpu

    cpu.prefer_fast_kernels()
    cpu.steady_malloc()
    import paddle
    import paddle.distributed as dist
    import paddle.nn.functional as F

    from paddle_mnist.network import models
    from paddle_mnist.ops import onednn
    from paddle_mnist.runtime import distributed
    from paddle_mnist.runtime.distributed import DistEnv
    from scripts import plain_loop

    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    coupled = args.mode not in ("none", "pause", "lockstep") and world > 1
    if coupled:
        dist.init_parallel_env()
    paddle.base.core.set_num_threads(1)
    cpu.set_openmp_threads(1)
    onednn.activate(onednn.prepare("auto"), "cpu")
    paddle.seed(rank)
    shape = plain_loop.image_shape(args.model)
    net = models.build_model(args.model, 10, shape)
    opt = plain_loop.optimizer(net)
    params = [p for p in net.parameters() if not p.stop_gradient]
    model = net
    dist_env = DistEnv(rank, world, rank, world, "gloo", "cpu")
    if coupled and args.mode in ("dataparallel", "shared"):
        sums = "shared-memory" if args.mode == "shared" else "gloo"
        model = distributed.wrap(net, dist_env, sums)
        if args.mode == "shared" and dist_env.carrier.local is None:
            raise SystemExit(f"the shared mode found no shared memory: {dist_env.carrier.note}")
    stream = GradientStream(net, world) if coupled and args.mode == "overlap" else None
    meeting = Meeting(rank, world) if args.mode == "lockstep" and world > 1 else None
    if args.spin:
        start_idle_spinner()
    if args.pin:  # every thread of this rank, Paddle's included, on one core of its own
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    if args.manual_gc:  # Python's collector only between steps, on the same steps on every rank
        gc.disable()
    if args.nice:  # this thread only: Paddle's transport threads and the overlap's thread, started above, keep 0
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.nice)
    xs = [paddle.randn([PER_WORKER, *shape]) for _ in range(4)]
    ys = [paddle.randint(0, 10, [PER_WORKER]) for _ in range(4)]
    one = paddle.zeros([1])
    clock, marks = time.perf_counter, []
    for i in range(args.steps):
        t0 = clock()
        with distributed.gradient_sync(model, dist_env, True):
            loss = F.cross_entropy(model(xs[i % 4]), ys[i % 4])
            t1 = clock()
            loss.backward()
        t2 = clock()
        if coupled and args.mode in ("barrier", "allreduce"):
            dist.all_reduce(one)
        if stream:
            stream.finish()
        if meeting:
            meeting.meet()
        if args.mode == "pause":
            time.sleep(PAUSE)
        t3 = clock()
        if coupled and args.mode == "allreduce":
            flat = paddle.concat([p.grad.reshape([-1]) for p in params])
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                n = int(p.grad.size)
                paddle.assign(flat[offset : offset + n].reshape(p.grad.shape), output=p.grad)
                offset += n
        distributed.average_gradients(model, dist_env)  # the shared mode's; nothing elsewhere
        t4 = clock()
        opt.step()
        opt.clear_grad()
        if args.manual_gc and i % args.manual_gc == 0:
            gc.collect()
        marks.append((t0, t1, t2, t3, t4, clock()))
    Path(args.out, f"{rank}.json").write_text(json.dumps(marks))


def start_idle_spinner() -> None:
    """--spin: a thread that keeps this rank's core busy while nothing else on it wants to run. SCHED_IDLE, so any
    thread that wakes takes the core from it at once; it spins in glibc's pthread_spin_lock on a lock that stays
    held, without the GIL (ctypes lets it go for the call) and without a system call, so the core never halts.
    Linux with glibc only (SystemExit elsewhere)."""
    import ctypes

    lib = ctypes.CDLL(None)
    lock = ctypes.create_string_buffer(64)  # a pthread_spinlock_t is an int: room to spare
    if lib.pthread_spin_init(lock, 0) != 0 or lib.pthread_spin_lock(lock) != 0:
        raise SystemExit("--spin: pthread_spin_lock failed")
    started = threading.Event()

    def spin() -> None:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        started.set()
        lib.pthread_spin_lock(lock)  # held above: spins until the process ends

    threading.Thread(target=spin, name="idle-spinner", daemon=True).start()
    if not started.wait(30):
        raise SystemExit("--spin: the spinning thread did not start")


class Meeting:
    """The lockstep mode's barrier, outside Paddle: every rank sends rank 0 one byte over TCP and waits for one
    back, which rank 0 sends once it has heard from all. Rank 0 listens on its own endpoint from the launcher
    (PADDLE_TRAINER_ENDPOINTS), which nothing else uses in this mode. Blocking reads, as gloo's waits block."""

    def __init__(self, rank: int, world: int):
        import socket

        host, port = os.environ["PADDLE_TRAINER_ENDPOINTS"].split(",")[0].rsplit(":", 1)
        self.rank, self.peers = rank, []
        if rank == 0:
            with socket.create_server((host, int(port)), backlog=world) as server:
                server.settimeout(120)
                self.peers = [server.accept()[0] for _ in range(world - 1)]
        else:
            deadline = time.monotonic() + 120
            while True:
                try:
                    self.peers = [socket.create_connection((host, int(port)), timeout=5)]
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        for peer in self.peers:
            peer.settimeout(120)
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def meet(self) -> None:
        if self.rank == 0:
            for peer in self.peers:
                if not peer.recv(1):
                    raise ConnectionError("a rank left the lockstep meeting")
            for peer in self.peers:
                peer.sendall(b"m")
        else:
            self.peers[0].sendall(b"m")
            if not self.peers[0].recv(1):
                raise ConnectionError("rank 0 left the lockstep meeting")


class GradientStream:
    """The overlap mode's all-reduce beside the backward pass. Paddle's gloo group runs an all-reduce to its end in
    the calling thread, so this hands each bucket to a thread: a backward hook reports each gradient when it is
    complete, the training thread flattens a full bucket divided by the world size (DataParallel's order), the
    thread all-reduces it, and finish() writes the averages back. Not in the trainer: with a worker on every core
    the thread must take a core from a worker at each of the ring's hops (docs/performance.md)."""

    def __init__(self, net, world_size: int, bucket_bytes: int = 256 * 1024):
        self.world_size, self.buckets, size = world_size, [], bucket_bytes
        params = [p for p in net.parameters() if not p.stop_gradient]
        for p in reversed(params):  # backward meets the last layers first
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.size * p.element_size()
        self.todo: queue.Queue = queue.Queue()
        self._reset()
        threading.Thread(target=self._carry, daemon=True).start()
        for b, members in enumerate(self.buckets):
            for p in members:
                p._register_backward_hook(self._hook(b))

    def _reset(self) -> None:
        self.missing = [len(b) for b in self.buckets]
        self.flat, self.done = [None] * len(self.buckets), [threading.Event() for _ in self.buckets]

    def _hook(self, b: int):
        def ready() -> None:
            self.missing[b] -= 1
            if self.missing[b] == 0:
                self._launch(b)

        return ready

    def _launch(self, b: int) -> None:
        import paddle

        self.missing[b] = -1
        self.flat[b] = paddle.concat([p.grad.reshape([-1]) for p in self.buckets[b]]).scale_(1.0 / self.world_size)
        self.todo.put(b)

    def _carry(self) -> None:
        import paddle.distributed as dist

        while True:
            b = self.todo.get()
            dist.all_reduce(self.flat[b])  # the training thread calls no collective until finish() returns
            self.done[b].set()

    def finish(self) -> None:
        import paddle

        for b, members in enumerate(self.buckets):
            self.done[b].wait()
            offset = 0
            for p in members:
                n = p.size
                paddle.assign(self.flat[b][offset : offset + n].reshape(p.grad.shape), output=p.grad)
                offset += n
        self._reset()


def analyse(runs: list[list[list[float]]], workers: int, window: int = WINDOW) -> dict:
    """Medians over ranks and steps of each phase (ms), the global rate and the ranks' own rates."""
    marks = [m[SKIP:] for m in runs]
    phases = {"forward": (0, 1), "backward": (1, 2), "wait": (2, 3), "all-reduce": (3, 4), "optimizer": (4, 5)}
    got = {name: statistics.median(1e3 * (s[b] - s[a]) for m in marks for s in m) for name, (a, b) in phases.items()}
    own = [PER_WORKER * (len(m) - 1) / (m[-1][0] - m[0][0]) for m in marks]  # each rank's images/s
    got["step"] = statistics.median(1e3 * (m[i + 1][0] - m[i][0]) for m in marks for i in range(len(m) - 1))
    got["rank_rates"] = own
    got["images_per_sec"] = sum(own) if len(own) == workers else 0.0
    got.update(persistence([[1e3 * (s[2] - s[0]) for s in m] for m in marks], window))
    return got


def persistence(compute: list[list[float]], window: int = WINDOW) -> dict:
    """Whether a rank's speed persists: each rank's compute time a step (start to end of backward, ms) over windows
    of `window` steps, as a share of all ranks' mean in that window. "persistence" is the correlation of those shares
    between one window and the next (0: a rank fast in one window is no likelier fast in the next); "split_gain" is
    what a batch split in proportion to the previous window's rates would have saved of the step's compute time,
    each rank's time taken to scale with its images (an estimate from the measured times, not a run of such a
    split); "ideal_gain", the same with each step's own rates known in advance."""
    ranks, steps = len(compute), min(len(c) for c in compute)
    if ranks < 2 or steps < 3 * window:
        return {}
    shares = []
    for w in range(steps // window):
        means = [statistics.fmean(c[w * window : (w + 1) * window]) for c in compute]
        shares.append([m / statistics.fmean(means) for m in means])
    before = [x for row in shares[:-1] for x in row]
    after = [x for row in shares[1:] for x in row]
    even = split = ideal = 0.0
    for w in range(1, len(shares)):
        speed = [1 / x for x in shares[w - 1]]
        part = [ranks * v / sum(speed) for v in speed]  # each rank's images, as a multiple of an even share
        for t in range(w * window, (w + 1) * window):
            now = [c[t] for c in compute]
            even += max(now)
            split += max(x * k for x, k in zip(now, part))
            ideal += ranks / sum(1 / x for x in now)
    return {"persistence": _correlation(before, after), "split_gain": 1 - split / even, "ideal_gain": 1 - ideal / even}


def _correlation(a: list[float], b: list[float]) -> float:
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5
    return cov / var if var else 0.0


def run_mode(mode: str, args, work: Path, env: dict) -> dict:
    out = work / mode
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    launch = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(args.workers)]
    launch += ["--log_dir", str(work / f"log-{mode}")]
    cmd = launch + [str(Path(__file__).resolve()), "worker", "--mode", mode, "--model", args.model]
    cmd += ["--steps", str(args.steps), "--out", str(out), "--nice", str(args.nice)] + ["--spin"] * args.spin
    cmd += ["--pin"] * args.pin + ["--manual-gc", str(args.manual_gc)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    files = sorted(out.glob("*.json"), key=lambda f: int(f.stem))
    if proc.returncode != 0 or len(files) != args.workers:
        logs = "".join(f.read_text()[-1500:] for f in sorted((work / f"log-{mode}").glob("workerlog.*"))[:2])
        raise SystemExit(f"mode {mode} failed ({len(files)} of {args.workers} ranks wrote):\n{logs}{proc.stderr}")
    return analyse([json.loads(f.read_text()) for f in files], args.workers, args.window)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("worker", help="(internal) one rank")
    w.add_argument("--mode", choices=MODES, required=True)
    w.add_argument("--model", required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--nice", type=int, default=0)
    w.add_argument("--spin", action="store_true")
    w.add_argument("--pin", action="store_true")
    w.add_argument("--manual-gc", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="mnist_cnn_bn_fc", help="a name of paddle_mnist.network.models.MODELS")
    p.add_argument("--steps", type=int, default=300, help=f"steps a run (the first {SKIP} not counted)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--window", type=int, default=WINDOW, help="steps a window of the persistence figures")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="the training thread's nice value (0 to 19); the threads that carry gradients keep 0, so a wake-up "
        "of theirs takes the core from the training thread at once (try it with the overlap mode)",
    )
    p.add_argument("--json", type=Path, help="write every round's figures here")
    p.add_argument(
        "--spin",
        action="store_true",
        help="every rank keeps its core busy while it waits: a thread of the lowest priority (SCHED_IDLE) spinning "
        "without the GIL, so the core never idles (Linux)",
    )
    p.add_argument(
        "--pin", action="store_true", help="each rank's threads on one core of their own (rank modulo cores)"
    )
    p.add_argument(
        "--manual-gc",
        type=int,
        default=0,
        metavar="N",
        help="Python's garbage collector off, and run by hand every N steps, the same on every rank (0: as usual)",
    )
    args = p.parse_args()
    if args.command == "worker":
        worker(args)
        return 0
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes) or args.steps <= SKIP + 2 or args.workers < 1 or not 0 <= args.nice <= 19:
        p.error(f"--modes of {', '.join(MODES)}; --steps above {SKIP + 2}; --workers at least 1; --nice 0 to 19")
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                results[mode].append(run_mode(mode, args, Path(tmp), env))
    setting = f", training thread at nice {args.nice}" if args.nice else ""
    setting += ", a spinning thread a rank" if args.spin else ""
    setting += ", pinned to a core each" if args.pin else ""
    setting += f", garbage collected by hand every {args.manual_gc} steps" if args.manual_gc else ""
    print(f"{args.model}, {args.workers} worker(s) x 1 thread{setting}, {PER_WORKER} images a worker a step, ", end="")
    print(f"{args.steps} steps")
    print(f"a run, {args.rounds} round(s); ms: median over ranks, steps and rounds; images/s: median of rounds")
    cols = ("forward", "backward", "wait", "all-reduce", "optimizer", "step")
    print(f"{'mode':<13}" + "".join(f"{c:>11}" for c in cols) + f"{'images/s':>11}{'of none':>9}")
    base = statistics.median(r["images_per_sec"] for r in results["none"]) if "none" in results else None
    for mode, rounds in results.items():
        row = "".join(f"{statistics.median(r[c] for r in rounds):>11.1f}" for c in cols)
        rate = statistics.median(r["images_per_sec"] for r in rounds)
        share = f"{rate / base:>9.2f}" if base else ""
        print(f"{mode:<13}{row}{rate:>11.0f}{share}")
    if "none" in results:
        own = [round(x) for r in results["none"] for x in r["rank_rates"]]
        print(f"none, each process's own images/s: {min(own)} to {max(own)} (all rounds)")
    print(f"whether a rank's speed persists ({args.window}-step windows; median of rounds; the gains are estimates):")
    for mode, rounds in results.items():
        if rounds and "persistence" in rounds[0]:
            got = {k: statistics.median(r[k] for r in rounds) for k in ("persistence", "split_gain", "ideal_gain")}
            print(
                f"  {mode:<13} persistence {got['persistence']:+.2f}, a split by the last window's rates "
                f"{100 * got['split_gain']:+.1f}% of compute time, by each step's own {100 * got['ideal_gain']:+.1f}%"
            )
    if args.json:
        kept = {"workers": args.workers, "model": args.model, "nice": args.nice, "spin": args.spin, "pin": args.pin}
        kept["manual_gc"] = args.manual_gc
        kept["results"] = results
        args.json.write_text(json.dumps(kept) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
