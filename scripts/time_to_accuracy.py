"""Time to accuracy: run one training recipe for several seeds and report when each reached the target(s).

    python -m scripts.time_to_accuracy --target 0.91 --seeds 1 2 3 -- --model mnist_cnn_bn --epochs 8
    python -m scripts.time_to_accuracy --target 0.8 0.85 0.9 --seeds 1 2 3 -- --dataset folder --data-dir DIR ...

Everything after `--` is passed to train.py as it is. Each seed runs on its own, one after another, the way a user
starts it (python -m paddle.distributed.launch --nproc_per_node W, or python train.py for one worker), into a
fresh output folder. A run's time to the target is the time_s of the first metrics.jsonl row whose val_acc
reaches it: seconds from the command's start (the launcher's) to the end of that epoch's evaluation; a target
that only the final test score reaches (with --tta, scored once at the end) counts the whole command. Prints one
line per seed and target, then the mean and range over the seeds; --json writes the same figures (a run's
time_to_target_s and epoch_at_target are the last --target's; `reached` holds every target's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paddle_mnist.files import plots

REPO = Path(__file__).resolve().parent.parent


def run_seed(args, seed: int, work: Path) -> dict:
    out, log_dir = work / f"seed{seed}", work / f"seed{seed}-log"
    launch = [sys.executable]
    if args.workers > 1:
        launch += ["-m", "paddle.distributed.launch", "--nproc_per_node", str(args.workers), "--log_dir", str(log_dir)]
    cmd = [*launch, str(REPO / "train.py"), *args.train_args, "--seed", str(seed), "--output-dir", str(out)]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - started
    if proc.returncode != 0:
        tail = proc.stdout[-2000:] + proc.stderr[-2000:]
        sys.exit(f"seed {seed} failed (exit {proc.returncode}); logs in {log_dir}\n{tail}")
    rows = plots.read_metrics(out / plots.METRICS_FILE)
    result = json.loads((out / "results.json").read_text())
    reached = []
    for target in args.target:
        hit = next((r for r in rows if r["val_acc"] >= target), None)
        if hit:
            reached.append({"target": target, "time_s": hit["time_s"], "epoch": hit["epoch"]})
        elif result["test_acc"] >= target:  # only the final score (--tta's) reached it: the whole command's time
            reached.append({"target": target, "time_s": wall, "epoch": "final"})
        else:
            reached.append({"target": target, "time_s": None, "epoch": None})
    return {
        "seed": seed,
        "reached": reached,
        "time_to_target_s": reached[-1]["time_s"],
        "epoch_at_target": reached[-1]["epoch"],
        "final_acc": result["test_acc"],
        "best_val_acc": max(r["val_acc"] for r in rows),
        "epochs": len(rows),
        "wall_s": wall,
        "val_acc_by_epoch": [r["val_acc"] for r in rows],
    }


def spread(values: list[float]) -> str:
    return f"mean {statistics.mean(values):.4g}, range {min(values):.4g} to {max(values):.4g}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--target", type=float, nargs="+", default=[0.91], help="validation accuracies to reach (several: each)"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one run per seed, in this order")
    p.add_argument("--workers", type=int, default=2, help="workers on this machine (1: python train.py)")
    p.add_argument("--work-dir", type=Path, help="keep the runs' outputs and logs here (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    args = p.parse_args(own)
    args.train_args = ["--log-every", "0", *train_args]
    sys.stdout.reconfigure(line_buffering=True)
    targets = " ".join(f"{t:g}" for t in args.target)
    print(f"target {targets}; {args.workers} worker(s); train.py {' '.join(train_args)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        runs = []
        for seed in args.seeds:
            r = run_seed(args, seed, work)
            runs.append(r)
            reached = "; ".join(
                f"{hit['target']:g} in {hit['time_s']:.0f} s (epoch {hit['epoch']})"
                if hit["time_s"] is not None
                else f"{hit['target']:g} not reached"
                for hit in r["reached"]
            )
            print(
                f"  seed {seed}: {reached}; final accuracy {r['final_acc']:.4f} after {r['epochs']} epochs; "
                f"command took {r['wall_s']:.0f} s"
            )
    complete = True
    for k, target in enumerate(args.target):
        times = [r["reached"][k]["time_s"] for r in runs if r["reached"][k]["time_s"] is not None]
        print(f"reached {target:g} in {len(times)} of {len(runs)} runs" + (f": {spread(times)} s" if times else ""))
        complete = complete and len(times) == len(runs)
    print(f"final accuracy: {spread([r['final_acc'] for r in runs])}")
    print(f"command time: {spread([r['wall_s'] for r in runs])} s")
    if args.json:
        report = {"targets": args.target, "workers": args.workers, "train_args": train_args, "runs": runs}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
