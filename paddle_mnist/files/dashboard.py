"""VisualDL scalars for --visualdl: rank 0's progress lines and epoch rows, in one file a resumed run continues.

visualdl is imported only when a Dashboard is opened, so without --visualdl the package need not be installed.
RunFiles owns the one Dashboard (rank 0's); nothing else writes to it.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import io
import logging
import struct
from pathlib import Path

from paddle_mnist.files import atomic
from paddle_mnist.files.log import memory_mb

FOLDER = "visualdl"  # inside --output-dir: visualdl --logdir OUTPUT_DIR/visualdl
LOG_GLOB = "vdlrecords*"  # VisualDL reads the files whose names hold "vdlrecords"
MISSING = (
    "--visualdl writes VisualDL logs, but the visualdl package is not installed: "
    "pip install -r requirements-visualdl.txt (or drop --visualdl)"
)

# Two groups of charts, named after what they mirror. VisualDL sorts the groups by name and opens only the first,
# so "epoch" (metrics.jsonl's curves) is what a user sees without a click; "step" holds the progress lines'.
EPOCH_GROUP = "epoch"  # a point per epoch at the step that ended it: epoch/<metrics.jsonl field>
EPOCH_FIELDS = (  # in the order of the charts
    "train_loss",
    "val_loss",
    "train_acc",
    "val_acc",
    "lr",
    "images_per_sec",
    "input_wait_share",
    "rss_mb",
    "epoch_time_s",
    "time_s",
)
EPOCH_TAGS = {field: f"{EPOCH_GROUP}/{field}" for field in EPOCH_FIELDS}
STEP_GROUP = "step"  # a point per progress line (--log-every): step/loss, step/acc, step/lr, ... step/rss_mb


def missing() -> str | None:
    """The one-line message when visualdl cannot be found, or None; looks for the package without importing it."""
    return MISSING if importlib.util.find_spec("visualdl") is None else None


def _frames(data: bytes):
    """The records of a VisualDL log: each an 8-byte little-endian length, then that many bytes (the framing of
    visualdl/writer/record_writer.py's RecordWriter.write). A last record cut short by a crash is left out."""
    at = 0
    while at + 8 <= len(data):
        (size,) = struct.unpack_from("<Q", data, at)
        if at + 8 + size > len(data):
            break
        yield data[at + 8 : at + 8 + size]
        at += 8 + size


def keep_to_step(path: Path, step: int, last_row_step: int) -> None:
    """Rewrite a log without the scalars a resumed run writes again: the progress scalars past the checkpoint's
    `step`, and the epoch scalars past `last_row_step`, the last metrics.jsonl row kept (a row for the part of an
    epoch that a --max-steps or a signal cut short is dropped there too). Left in, VisualDL's reader would show
    both points of a step, a doubled curve. Only the first meta record is kept, as the resumed writer adds its
    own. Written to a temporary file and renamed."""
    from visualdl.proto import record_pb2  # here, not at the top: the package is optional

    epoch_tags = set(EPOCH_TAGS.values())
    kept, meta = [], False
    for frame in _frames(path.read_bytes()):
        record = record_pb2.Record()
        record.ParseFromString(frame)
        if record.values[0].WhichOneof("one_value") == "meta_data":
            if meta:
                continue
            meta = True
        elif any(v.id > (last_row_step if v.tag in epoch_tags else step) for v in record.values):
            continue
        kept.append(struct.pack("<Q", len(frame)) + frame)
    atomic.write_bytes(path, b"".join(kept))


def remove_logs(out: Path) -> None:
    """A fresh run's start: an earlier run's curves must not pass for this run's (the flag need not be on)."""
    for old in (out / FOLDER).glob(LOG_GLOB):
        if old.is_file():
            old.unlink()


class Dashboard:
    """One VisualDL log in OUTPUT_DIR/visualdl. On resume the newest log (the one VisualDL shows) is cut back to
    the checkpoint and continued, so the dashboard keeps one run whose curves go on where they stopped.

    resumed: None for a new run, else (the checkpoint's step, the step of the last metrics.jsonl row kept).
    """

    def __init__(self, out: Path, resumed: tuple[int, int] | None):
        from visualdl import LogWriter  # here, not at the top: the package is optional

        folder = out / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        name = ""  # a new file, named by VisualDL (vdlrecords.<seconds>.log)
        logs = sorted(folder.glob(LOG_GLOB))
        if resumed is not None and logs:
            keep_to_step(logs[-1], *resumed)
            name = logs[-1].name  # LogWriter appends to an existing file of this name
        with contextlib.redirect_stdout(io.StringIO()):  # it prints that it appends, in its own words
            self._writer = LogWriter(logdir=str(folder), file_name=name)
        self.path = Path(self._writer.file_name)
        self._open = True
        atexit.register(self.close)  # a run stopped by an exception still writes what it queued

    def add(self, step: int, scalars: dict[str, float]) -> None:
        if self._open:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag=tag, value=float(value), step=step)

    def add_epoch(self, row: dict) -> None:
        """metrics.jsonl's row, at the step that ended the epoch."""
        self.add(row["step"], {tag: row[field] for field, tag in EPOCH_TAGS.items()})

    def add_progress(self, step: int, scalars: dict[str, float]) -> None:
        """A progress line's figures (engine.Epoch's), and this process's memory now."""
        self.add(step, {f"{STEP_GROUP}/{k}": v for k, v in {**scalars, "rss_mb": memory_mb()[0]}.items()})

    def flush(self) -> None:
        """Wait until every queued record is in the file (VisualDL writes on a thread of its own)."""
        if self._open:
            self._writer.flush()

    def close(self) -> None:
        if self._open:
            self._open = False
            self._writer.close()


class ProgressScalars(logging.Handler):
    """Passes the figures that a progress line carries (log.info(..., extra={"step": ..., "scalars": {...}}))
    to the dashboard; lines without figures are ignored."""

    def __init__(self, dashboard: Dashboard):
        super().__init__()
        self.dashboard = dashboard

    def emit(self, record: logging.LogRecord) -> None:
        scalars = getattr(record, "scalars", None)
        if scalars:
            self.dashboard.add_progress(record.step, scalars)
