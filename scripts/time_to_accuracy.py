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

--torch-python PYTHON (with --torch-data NPZ from `scripts.torch_recipes prepare`) also runs, for each seed,
PyTorch on the same network and recipe (`scripts.torch_recipes time`: cifar_fast's record recipe, one process with
--workers threads), the two alternating which goes first from seed to seed. Its times count from its command's
start as well; its plain score after each epoch and final six-view score are judged like the trainer's.

    python -m scripts.time_to_accuracy --target 0.8 0.85 0.9 --seeds 1 2 --torch-python PY --torch-data NPZ -- \
        --dataset folder --data-dir DIR --augment --flip --tta --tta-shift --val-split 0 --model cifar_fast
"""

from __future__ import annotations

import argparse
import json
import os
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
    accs, times = [r["val_acc"] for r in rows], [r["time_s"] for r in rows]
    return report(args, seed, accs, times, result["test_acc"], wall, best_val_acc=max(accs))


def report(args, seed: int, accs: list[float], times: list[float], final: float, wall: float, **more) -> dict:
    """One run's figures: each target's time and epoch (judged), the final score, the epochs' scores and times."""
    reached = judged(args.target, accs, times, final, wall)
    return {
        "seed": seed,
        "reached": reached,
        "time_to_target_s": reached[-1]["time_s"],
        "epoch_at_target": reached[-1]["epoch"],
        "final_acc": final,
        **more,
        "epochs": len(accs),
        "wall_s": wall,
        "val_acc_by_epoch": accs,
        "time_s_by_epoch": times,
    }


def judged(targets: list[float], accs: list[float], times: list[float], final: float, wall: float) -> list[dict]:
    """Each target's time and epoch: the first epoch whose plain score reaches it, else the final score's (the
    whole command), else not reached."""
    reached = []
    for target in targets:
        hit = next((k for k, acc in enumerate(accs) if acc >= target), None)
        if hit is not None:
            reached.append({"target": target, "time_s": times[hit], "epoch": hit + 1})
        elif final >= target:
            reached.append({"target": target, "time_s": wall, "epoch": "final"})
        else:
            reached.append({"target": target, "time_s": None, "epoch": None})
    return reached


def run_torch(args, seed: int) -> dict:
    """scripts.torch_recipes time, seed `seed`, --workers threads; its epochs' times from this command's start."""
    cmd = [str(args.torch_python), "-m", "scripts.torch_recipes", "time", str(args.torch_data), "--seed", str(seed)]
    if args.torch_override:
        cmd += ["--override", args.torch_override]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.workers)}
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    wall = time.time() - started
    if proc.returncode != 0:
        sys.exit(f"PyTorch seed {seed} failed (exit {proc.returncode})\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    times = [round(r["began_at"] - started + t, 1) for t in r["times"]]
    return report(args, seed, r["accs"], times, r["final"], wall, threads=r["threads"])


def describe(r: dict) -> str:
    reached = "; ".join(
        f"{hit['target']:g} in {hit['time_s']:.0f} s (epoch {hit['epoch']})"
        if hit["time_s"] is not None
        else f"{hit['target']:g} not reached"
        for hit in r["reached"]
    )
    final = f"final accuracy {r['final_acc']:.4f} after {r['epochs']} epochs"
    return f"{reached}; {final}; command took {r['wall_s']:.0f} s"


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
    p.add_argument("--torch-python", type=Path, help="a Python with PyTorch: also run the record recipe in PyTorch")
    p.add_argument("--torch-data", type=Path, help="with --torch-python: the .npz of scripts.torch_recipes prepare")
    p.add_argument("--torch-override", help='with --torch-python: JSON changes to its recipe, e.g. {"epochs": 11}')
    args = p.parse_args(own)
    if args.torch_python and not (args.torch_data and args.torch_data.is_file()):
        p.error("--torch-python needs --torch-data: the .npz that `python -m scripts.torch_recipes prepare` writes")
    args.train_args = ["--log-every", "0", *train_args]
    sys.stdout.reconfigure(line_buffering=True)
    targets = " ".join(f"{t:g}" for t in args.target)
    print(f"target {targets}; {args.workers} worker(s); train.py {' '.join(train_args)}")
    contenders = ["trainer", *(["pytorch"] if args.torch_python else [])]
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for k, seed in enumerate(args.seeds):
            for name in contenders[k % 2 :] + contenders[: k % 2]:  # who goes first alternates from seed to seed
                r = run_seed(args, seed, work) if name == "trainer" else run_torch(args, seed)
                runs[name].append(r)
                print(f"  {name} seed {seed}: {describe(r)}")
    complete = True
    for name in contenders:
        done = runs[name]
        for k, target in enumerate(args.target):
            times = [r["reached"][k]["time_s"] for r in done if r["reached"][k]["time_s"] is not None]
            got = f"reached {target:g} in {len(times)} of {len(done)} runs" + (f": {spread(times)} s" if times else "")
            print(f"{name}: {got}")
            complete = complete and (name != "trainer" or len(times) == len(done))
        print(f"{name}: final accuracy: {spread([r['final_acc'] for r in done])}")
        print(f"{name}: command time: {spread([r['wall_s'] for r in done])} s")
    if args.json:
        report = {"targets": args.target, "workers": args.workers, "train_args": train_args, "runs": runs["trainer"]}
        if args.torch_python:
            report["pytorch"] = {"override": args.torch_override, "runs": runs["pytorch"]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
