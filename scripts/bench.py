"""Training throughput of this trainer against a hand-written Paddle loop, paddle.Model.fit, the tutorials' loop
and the same loop in PyTorch.

    python -m scripts.bench                   # Fashion-MNIST, mnist_cnn, global batch 128, 1 and 2 workers

Every contender trains the same model on the same data with the same global batch, optimizer, thread settings and
world size, each in fresh processes (python -m paddle.distributed.launch for 2+ workers), in one run. Each process
times a few windows after one warm-up window; the contenders take turns, round after round (the order reversed every
other round), so that a slow spell of a shared machine falls on all of them. A contender's figure is the median of
all its windows, in global images/s. The trainer is run exactly as users run it (python train.py, or under the
launcher) and read from its metrics.jsonl, one short epoch per window; it runs twice, with the per-step timing
breakdown on (its default) and off, so the cost of the breakdown shows. The hand-written loops
(scripts/plain_loop.py) train the tutorial's layers as written (MnistCNN(plain=True)); "bare-mkl" is the same loop
with the MKL setting the trainer makes on AMD processors (paddle_mnist/runtime/cpu.py), which tells that lever apart
from the network's faster forward. "torch" runs where PyTorch is installed (never a requirement) and is skipped
otherwise. Writes a table, JSON (--json) and scaling.png (--plot); then measures the peak resident memory per worker
of a short trainer run for each dataset and model (--no-memory skips that,
--memory-only does only that).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paddle_mnist.config import PER_WORKER_BATCH
from paddle_mnist.datasets import data
from paddle_mnist.datasets.download import write_mnist_json
from paddle_mnist.files import plots
from paddle_mnist.runtime import cpu
from scripts.bench_input import generate_cifar_archive

REPO = Path(__file__).resolve().parent.parent
CONTENDER_SCRIPT = Path(__file__).resolve().parent / "bench_contenders.py"  # a script path, as the launchers want

CONTENDERS = {
    "bare": "hand-written loop",
    "bare-mkl": "hand-written loop, MKL AVX2",
    "trainer": "this trainer",
    "trainer-untimed": "this trainer, --timing-every 0",
    "fit": "paddle.Model.fit",
    "tutorial": "tutorial generator",
    "torch": "PyTorch DDP loop",
}
MEMORY_RUNS = (  # (dataset, model) pairs whose peak memory is measured with a short trainer run
    ("fashion-mnist", "mnist_cnn_bn_fc"),  # the default
    ("fashion-mnist", "mnist_cnn"),
    ("mnist-json", "mnist_cnn"),
    ("cifar10", "mnist_cnn"),
    ("cifar10", "cifar_cnn"),
    ("cifar10", "minigooglenet"),
)
PEAK = re.compile(r"peak memory (\d+) MiB")


def launcher(workers: int, log_dir: Path, torch: bool = False) -> list[str]:
    if workers == 1:
        return [sys.executable]
    if torch:  # its ranks rendezvous on a free port of this machine
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        run = [sys.executable, "-m", "torch.distributed.run"]
        return [*run, "--nproc_per_node", str(workers), "--master_port", str(port)]
    launch = [sys.executable, "-m", "paddle.distributed.launch"]
    return [*launch, "--nproc_per_node", str(workers), "--log_dir", str(log_dir)]


def run(cmd: list[str], env: dict, what: str, log_dir: Path) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stdout[-1500:] + proc.stderr[-1500:]
        sys.exit(f"{what} failed (exit {proc.returncode}); its logs: {log_dir}\n{tail}")
    return proc.stdout


def worker_text(stdout: str, workers: int, log_dir: Path) -> list[str]:
    """Each worker's log: stdout for one process, the launcher's workerlog.N otherwise."""
    if workers == 1:
        return [stdout]
    return [(log_dir / f"workerlog.{r}").read_text() for r in range(workers)]


def fresh(*folders: Path) -> None:
    """Remove a previous round's run: the launcher appends to old worker logs, the trainer refuses old results."""
    for folder in folders:
        if folder.exists():
            shutil.rmtree(folder)


def run_trainer(args, workers: int, work: Path, name: str, extra: list[str]) -> dict:
    out, log_dir = work / name, work / f"{name}-log"
    fresh(out, log_dir)
    cmd = launcher(workers, log_dir) + [str(REPO / "train.py"), "--data-dir", str(args.data_dir)]
    cmd += ["--model", "mnist_cnn"]  # the network every other contender trains
    cmd += ["--batch-size", str(args.batch), "--train-limit", str(args.batch * args.steps)]
    cmd += ["--epochs", str(args.windows + 1), "--eval-limit", "1000", "--log-every", "0"]
    cmd += ["--output-dir", str(out), *extra]
    stdout = run(cmd, args.env[workers], f"the trainer ({workers} workers)", log_dir)
    rows = plots.read_metrics(out / plots.METRICS_FILE)
    peaks = [float(PEAK.findall(text)[-1]) for text in worker_text(stdout, workers, log_dir)]
    return {"rates": [r["images_per_sec"] for r in rows[1:]], "peak_mb": peaks, "shares": rows[-1]["step_time_shares"]}


def run_contender(args, contender: str, workers: int, work: Path) -> dict:
    if contender == "trainer":
        return run_trainer(args, workers, work, f"trainer-w{workers}", [])
    if contender == "trainer-untimed":
        return run_trainer(args, workers, work, f"untimed-w{workers}", ["--timing-every", "0"])
    log_dir, out = work / f"{contender}-w{workers}-log", work / f"{contender}-w{workers}"
    fresh(log_dir)  # the ranks' JSON is rewritten, the logs must be emptied
    loop = "bare" if contender == "bare-mkl" else contender
    cmd = launcher(workers, log_dir, torch=contender == "torch") + [str(CONTENDER_SCRIPT), loop]
    cmd += ["--data-dir", str(args.data_dir), "--batch", str(args.batch), "--steps", str(args.steps)]
    cmd += ["--windows", str(args.windows), "--threads", str(threads_for(workers)), "--out", str(out)]
    env = dict(args.env[workers], **(args.mkl if contender == "bare-mkl" else {}))
    run(cmd, env, f"{contender} ({workers} workers)", log_dir)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(workers)]
    return {"rates": ranks[0]["rates"], "peak_mb": [r["peak_mb"] for r in ranks]}


def threads_for(workers: int) -> int:
    """What the trainer chooses by itself for this many workers on one node."""
    return cpu.threads_per_worker(0, workers)


def memory_runs(args, work: Path) -> list[dict]:
    """Peak resident memory per worker of a few trainer steps on each dataset and model (--memory-workers)."""
    print(f"peak resident memory per worker, {args.memory_workers} workers, 3 steps:")
    cifar = work / "cifar10"
    cifar.mkdir()
    generate_cifar_archive(cifar / data.CIFAR_ARCHIVE)
    sources = {"fashion-mnist": args.data_dir, "cifar10": cifar, "mnist-json": work / data.MNIST_JSON}
    write_mnist_json(args.data_dir, sources["mnist-json"])  # the course's layout, from the Fashion-MNIST files
    rows = []
    for dataset, model in MEMORY_RUNS:
        log_dir, workers = work / f"mem-{dataset}-{model}-log", args.memory_workers
        cmd = launcher(workers, log_dir) + [str(REPO / "train.py"), "--dataset", dataset]
        cmd += ["--data-dir", str(sources[dataset]), "--model", model, "--max-steps", "3", "--eval-limit", "200"]
        cmd += ["--log-every", "0", "--output-dir", str(work / f"mem-{dataset}-{model}")]
        t = time.perf_counter()
        stdout = run(cmd, args.env[workers], f"the memory run {dataset}/{model}", log_dir)
        peaks = [float(PEAK.findall(text)[-1]) for text in worker_text(stdout, workers, log_dir)]
        rows.append({"dataset": dataset, "model": model, "workers": workers, "peak_mb": peaks})
        text = ", ".join(f"{p:,.0f}" for p in peaks)
        print(f"  {dataset:<14} {model:<14} {text:>16} MiB  ({time.perf_counter() - t:.0f} s)")
    return rows


def merge(rounds: list[dict]) -> dict:
    """One process's figures per round -> all windows of all rounds, the peak memory of the largest round."""
    rates = [x for r in rounds for x in r["rates"]]
    return {
        "rates": rates,
        "round_medians": [statistics.median(r["rates"]) for r in rounds],
        "median": statistics.median(rates),
        "peak_mb": [max(ms) for ms in zip(*(r["peak_mb"] for r in rounds))],
        "shares": rounds[-1].get("shares"),
    }


def targets(results: dict, workers: list[int]) -> list[tuple[str, float, float, bool]]:
    """(what, measured, target, met) for each of the issue's targets that this run measured."""
    rows = []
    med = {c: {w: r["median"] for w, r in by.items()} for c, by in results.items()}
    for w in workers:
        if "trainer" in med and "bare" in med:
            ratio = med["trainer"][w] / med["bare"][w]
            rows.append((f"trainer / hand-written loop, {w} worker(s)", ratio, 1.2, ratio >= 1.2))
        if "trainer" in med and "fit" in med:
            ratio = med["trainer"][w] / med["fit"][w]
            rows.append((f"trainer / Model.fit, {w} worker(s)", ratio, 1.5, ratio >= 1.5))
        if "trainer" in med and "trainer-untimed" in med:
            ratio = med["trainer"][w] / med["trainer-untimed"][w]
            rows.append((f"timing on / off, {w} worker(s)", ratio, 0.99, ratio >= 0.99))
    if "trainer" in med and 1 in workers and len(workers) > 1:  # against Paddle's own 1-worker figures
        best_one = max(by[1] for c, by in med.items() if 1 in by and c != "torch")
        most = max(workers)
        ratio = med["trainer"][most] / best_one
        rows.append((f"trainer at {most} workers / best 1-worker figure", ratio, 1.0, ratio >= 1.0))
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for contender, by in results.items():
        ws = sorted(by)
        ax.plot(ws, [by[w]["median"] for w in ws], marker="o", label=CONTENDERS[contender])
    ax.set_xlabel("workers (processes)")
    ax.set_ylabel("global images/s (median window)")
    ax.set_xticks(sorted({w for by in results.values() for w in by}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Fashion-MNIST, mnist_cnn, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=data.REPO_DATA / "fashion-mnist", help="Fashion-MNIST idx files")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="world sizes to measure")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    p.add_argument(
        "--batch", type=int, default=2 * PER_WORKER_BATCH, help="global batch (the tutorials' per-worker batch at 2)"
    )
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per timed window")
    p.add_argument("--windows", type=int, default=3, help="timed windows per process, after one warm-up window")
    p.add_argument("--rounds", type=int, default=2, help="times each contender runs, taking turns with the others")
    p.add_argument("--memory-workers", type=int, default=2, help="workers of the memory runs")
    p.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    p.add_argument("--memory-only", action="store_true", help="only the memory runs, no throughput rounds")
    p.add_argument("--json", type=Path, default=Path("bench.json"), help="where to write the figures")
    p.add_argument("--plot", type=Path, default=Path("scaling.png"), help="where to draw images/s versus workers")
    args = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show up at once when piped to a file
    started = time.perf_counter()
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", cpu.MKL_CODE_PATH)}
    sizes = (*args.workers, args.memory_workers)
    args.env = {w: dict(base, OMP_NUM_THREADS=str(threads_for(w)), PYTHONPATH=str(REPO)) for w in sizes}
    if args.memory_only:
        with tempfile.TemporaryDirectory() as tmp:
            memory = memory_runs(args, Path(tmp))
        args.json.write_text(json.dumps({"memory": memory}, indent=2) + "\n")
        print(f"wrote {args.json}")
        return 0
    if "torch" in args.contenders and importlib.util.find_spec("torch") is None:
        print("PyTorch is not installed here: the torch contender is skipped (pip install torch to run it)")
        args.contenders = [c for c in args.contenders if c != "torch"]
    with open("/proc/cpuinfo") as f:  # what the trainer sets by itself on this processor
        args.mkl = cpu.mkl_settings(f.read(), {})
    if "bare-mkl" in args.contenders and not args.mkl:
        print("the trainer changes no MKL setting on this processor: the bare-mkl contender is skipped")
        args.contenders = [c for c in args.contenders if c != "bare-mkl"]
    cores = os.cpu_count()
    print(
        f"{cores} cores; global batch {args.batch}; {args.rounds} rounds of {args.windows} windows of {args.steps} "
        "steps after 1 warm-up window"
    )

    runs: dict[str, dict[int, list[dict]]] = {c: {w: [] for w in args.workers} for c in args.contenders}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for k in range(args.rounds):
            for w in args.workers:
                for c in args.contenders if k % 2 == 0 else args.contenders[::-1]:
                    t = time.perf_counter()
                    runs[c][w].append(run_contender(args, c, w, work))
                    median = statistics.median(runs[c][w][-1]["rates"])
                    took = time.perf_counter() - t
                    print(f"  round {k + 1} {c:<16} {w} worker(s): {median:7.0f} img/s ({took:.0f} s)")
        results = {c: {w: merge(rs) for w, rs in by.items()} for c, by in runs.items()}
        memory = []
        if not args.no_memory:
            print()
            memory = memory_runs(args, work)

    head = f"{'workers':>7} {'threads':>7} {'img/s':>7} {'range':>13} {'vs bare':>8} {'peak MiB':>14}"
    print(f"\n{'contender':<32} {head}")
    for c, by in results.items():
        for w, r in sorted(by.items()):
            vs = f"{r['median'] / results['bare'][w]['median']:.3f}" if "bare" in results else "-"
            rng = f"{min(r['rates']):.0f}-{max(r['rates']):.0f}"
            peaks = "/".join(f"{m:.0f}" for m in r["peak_mb"])
            print(f"{CONTENDERS[c]:<32} {w:>7} {threads_for(w):>7} {r['median']:>7.0f} {rng:>13} {vs:>8} {peaks:>14}")
    checks = targets(results, args.workers)
    print(f"\n{'target':<48} {'measured':>8} {'target':>7}")
    for what, value, goal, met in checks:
        print(f"{what:<48} {value:>8.3f} {goal:>7.2f}  {'met' if met else 'MISSED'}")
    for w in args.workers:
        shares = results.get("trainer", {}).get(w, {}).get("shares")
        if shares:
            text = ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items() if v is not None)
            print(f"trainer step time, {w} worker(s), rank 0, last window: {text}")
    elapsed = time.perf_counter() - started
    print(f"\nbench took {elapsed / 60:.1f} min")
    report = {
        "cores": cores,
        "global_batch": args.batch,
        "steps_per_window": args.steps,
        "windows": args.windows,
        "results": {c: {str(w): r for w, r in by.items()} for c, by in results.items()},
        "targets": [{"what": w, "measured": v, "target": g, "met": m} for w, v, g, m in checks],
        "memory": memory,
        "seconds": elapsed,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    plot(results, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
