"""The only writer of files: rank 0 writes, every other rank's calls do nothing."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import paddle

from paddle_mnist.config import CONFIG_FILE, Config
from paddle_mnist.datasets import data
from paddle_mnist.deploy import export
from paddle_mnist.files import atomic, checkpoint, dashboard, plots, report
from paddle_mnist.runtime.distributed import DistEnv

METRICS = plots.METRICS_FILE
CONFIG = CONFIG_FILE
RESULTS = "results.json"
MODEL_SUMMARY = "model_summary.txt"  # paddle.summary's table of layers, input and output shapes and parameters
WEIGHTS = checkpoint.WEIGHTS  # the last weights
BEST_WEIGHTS = checkpoint.BEST_WEIGHTS  # the weights of the epoch with the highest validation accuracy
REPORT_FILES = (report.REPORT_FILE, report.EXAMPLES_FILE, report.CONFUSION_FILE, report.PAIRS_FILE)
RESULT_FILES = (METRICS, WEIGHTS, BEST_WEIGHTS, "inference_meta.json", checkpoint.CKPT_DIR)


class WriteFailed(RuntimeError):
    """A file of the run could not be written; every rank stops. The message is the one line each rank logs."""


def output_dir_problem(cfg: Config) -> str | None:
    """Why this run may not write into --output-dir, or None when it may."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        return f"--output-dir {out} is a file; pass a folder"
    existing = [name for name in RESULT_FILES if (out / name).exists()]
    has_checkpoint = bool(checkpoint.list_checkpoints(out))
    if cfg.resume == "yes" and not has_checkpoint:
        return f"--resume: no checkpoint in {out / checkpoint.CKPT_DIR}; drop --resume to start afresh"
    if cfg.resume != "no" and has_checkpoint:
        return None
    if existing and not cfg.overwrite:
        return (
            f"{out} already holds a run's results ({', '.join(existing)}); "
            "pass --resume to continue it, --overwrite to replace it, or another --output-dir"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return f"cannot write to --output-dir {out} ({e.strerror}); pass a writable folder"
    return None


PLOT_INTERVAL_S = 60.0  # shortest time between two drawings of curves.png during training


class RunFiles:
    def __init__(self, cfg: Config, env: DistEnv):
        self.out = Path(cfg.output_dir)
        self.enabled = env.is_main
        self.cfg = cfg
        self._plotter: subprocess.Popen | None = None
        self._report_plotter: subprocess.Popen | None = None  # the report's pictures, drawn by a child
        self._drawn_at = -float("inf")
        self._rows = 0
        self.dashboard: dashboard.Dashboard | None = None  # --visualdl's writer, opened by start()
        self._listening: tuple[logging.Logger, logging.Handler] | None = None  # the dashboard's log handler
        self.failure: str | None = None  # the first write that failed: its file and the system's reason

    @contextlib.contextmanager
    def writing(self, path: Path):
        """Record a write's OSError instead of raising it, so that every rank can learn of it at the next point
        where they all meet (Session.meet, Checkpoints.failure) and stop together; later writes are skipped."""
        try:
            yield
        except OSError as e:
            code = f" ({errno.errorcode[e.errno]})" if e.errno in errno.errorcode else ""
            self.failure = self.failure or f"cannot write {path}: {e.strerror or e}{code}"

    def open(self, resumed_epoch: int | None, resumed_step: int = 0, log: logging.Logger | None = None) -> None:
        """Write config.json; on resume, drop metrics rows past the checkpoint, on overwrite, all of them.

        With --visualdl, open the dashboard at the checkpoint's step and pass it the progress lines of `log`.
        """
        if not self.enabled or self.failure:
            return
        with self.writing(self.out):
            last_row_step = self._start(resumed_epoch)
        if self.cfg.visualdl and not self.failure:
            self._open_dashboard(None if resumed_epoch is None else (resumed_step, last_row_step), log)

    def _open_dashboard(self, resumed: tuple[int, int] | None, log: logging.Logger | None) -> None:
        with self.writing(self.out / dashboard.FOLDER):
            try:
                self.dashboard = dashboard.Dashboard(self.out, resumed)
            except ImportError as e:  # found by parse_args, yet it does not import: a broken installation
                self.failure = f"{dashboard.MISSING} ({type(e).__name__}: {e})"
        if self.dashboard and log:
            self._listening = (log, dashboard.ProgressScalars(self.dashboard))
            log.addHandler(self._listening[1])

    def _start(self, resumed_epoch: int | None) -> int:
        """The step of the last metrics row kept (0: none)."""
        self.out.mkdir(parents=True, exist_ok=True)
        atomic.write_text(self.out / CONFIG, self.cfg.to_json() + "\n")
        metrics = self.out / METRICS
        if resumed_epoch is None:
            metrics.unlink(missing_ok=True)
            dashboard.remove_logs(self.out)
            best = self.out / BEST_WEIGHTS
            earlier = [best, checkpoint.digest_path(best), *checkpoint.list_checkpoints(self.out)]
            reports = [self.out / report.FOLDER / name for name in REPORT_FILES]
            for old in [*earlier, *self.out.glob("inference*"), *reports]:
                if not old.is_dir():  # a user's folder is left alone
                    old.unlink(missing_ok=True)  # an earlier run's export or report must not pass for this run's
        elif metrics.is_file():
            rows = [r for r in metrics.read_text().splitlines() if r.strip()]
            kept = [r for r in rows if json.loads(r)["epoch"] <= resumed_epoch]
            atomic.write_text(metrics, "".join(r + "\n" for r in kept))
            return json.loads(kept[-1])["step"] if kept else 0
        return 0

    def append_metrics(self, row: dict) -> None:
        if not self.enabled or self.failure:
            return
        path = self.out / METRICS
        with self.writing(path):
            with open(path, "a") as f:
                size = f.tell()
                try:
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                except OSError:
                    with contextlib.suppress(OSError):
                        f.truncate(size)  # no half row: the file ends with the last complete epoch
                    raise
        if self.failure:
            return
        if self.dashboard:
            self.dashboard.add_epoch(row)
        self._rows += 1
        idle = self._plotter is None or self._plotter.poll() is not None  # one drawing at a time
        if idle and time.monotonic() - self._drawn_at >= PLOT_INTERVAL_S:
            self._plotter = self._draw()

    def _draw(self) -> subprocess.Popen:
        """curves.png is drawn by a child process, so the trainer never loads matplotlib and its memory stays flat.

        Loading matplotlib costs about a second of CPU: the child runs at the lowest priority, and at most once a
        PLOT_INTERVAL_S, so that on a machine whose cores all train it does not slow the workers down.
        """
        self._drawn_at = time.monotonic()
        cmd = [sys.executable, plots.__file__, "--low-priority", str(self.out)]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)

    def finish(self) -> None:
        """Close the dashboard; wait for a drawing under way, then draw the final curves; wait for the report's."""
        if self._listening:
            self._listening[0].removeHandler(self._listening[1])
        if self.dashboard:
            self.dashboard.close()
        if self.enabled and self._rows:
            if self._plotter is not None:
                self._plotter.wait()
            self._draw().wait()
        if self._report_plotter is not None:
            self._report_plotter.wait()

    def write_report(self, contents: dict, images: dict[int, np.ndarray]) -> None:
        """OUTPUT_DIR/report/: report.json and the example images, then its pictures drawn by a child process at
        the lowest priority (as the curves are), which finish() waits for."""
        if not self.enabled or self.failure:
            return
        folder = self.out / report.FOLDER
        with self.writing(folder / report.REPORT_FILE):
            report.write(folder, contents, images)
        if not self.failure:
            cmd = [sys.executable, report.__file__, "--low-priority", str(folder)]
            self._report_plotter = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)

    def save_checkpoint(self, path: Path, contents: dict) -> bool:
        """Rank 0: a checkpoint at path (checkpoint.save_atomic), once the dashboard's scalars up to its step are on
        disk. Whether it was written (False on other ranks, and once a write has failed)."""
        if not self.enabled or self.failure:
            return False
        if self.dashboard:  # every scalar up to the checkpoint's step is on disk before the checkpoint is
            self.dashboard.flush()
        with self.writing(path):
            checkpoint.save_atomic(contents, path)
        return self.failure is None

    def save_weights(self, model: paddle.nn.Layer, name: str = WEIGHTS) -> None:
        """Rank 0: the model's weights as OUTPUT_DIR/name: model.pdparams (the last) or model_best.pdparams."""
        if self.enabled and not self.failure:
            with self.writing(self.out / name):
                checkpoint.save_atomic(model.state_dict(), self.out / name)

    def export_inference(self, net: paddle.nn.Layer, ds: data.Dataset, weights: str) -> None:
        """The unwrapped network for python -m paddle_mnist.predict --model OUTPUT_DIR/inference."""
        if self.enabled:
            export.export_inference(net, ds, self.out / "inference", weights)

    def write_json(self, name: str, obj: dict) -> None:
        self.write_text(name, json.dumps(obj, indent=2) + "\n")

    def write_text(self, name: str, text: str) -> None:
        if self.enabled and not self.failure:
            with self.writing(self.out / name):
                atomic.write_text(self.out / name, text if text.endswith("\n") else text + "\n")
