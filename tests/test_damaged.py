"""Checkpoints that cannot be trusted: truncated, bit-flipped, crafted to run code; and a write that fails."""

from __future__ import annotations

import hashlib
import os
import pickle
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TRAIN_PY, explain, launch_env, make_dataset, run_single, small_run, worker_log

from paddle_mnist.files import checkpoint

ARGS = small_run(eval_limit=64, batch_size=64, epochs=2, log_every=0)  # 8 steps an epoch


class Payload:
    """Unpickled by paddle.load, this creates the file: what a hostile checkpoint would do."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def write_with_digest(path: Path, data: bytes) -> None:
    """As an attacker with write access would: a matching digest beside it, so only the loader can refuse it."""
    path.write_bytes(data)
    checkpoint.digest_path(path).write_text(f"{hashlib.sha256(data).hexdigest()}  {path.name}\n")


def one_line(text: str, marker: str) -> str:
    lines = [line for line in text.splitlines() if marker in line]
    assert len(lines) == 1, f"{len(lines)} lines with {marker!r}:\n{text[-3000:]}"
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[str]]:
    """A finished run's output folder holding its last four checkpoints (steps 10, 12, 14 and 16), and its args."""
    root = tmp_path_factory.mktemp("trained")
    args = [*ARGS, "--data-dir", str(make_dataset(root / "mnist", n_train=512, n_test=64))]
    out = root / "o"
    first = run_single([*args, "--output-dir", str(out), "--save-every-steps", "2", "--keep-checkpoints", "4"], root)
    assert first.returncode == 0, explain(first)
    return out, args


def copy_run(trained_dir: Path, to: Path) -> Path:
    shutil.copytree(trained_dir, to)
    return to


@pytest.mark.slow
def test_resume_sets_aside_crafted_bitflipped_and_truncated_checkpoints_and_uses_the_intact_one(tmp_path, trained):
    out, args = copy_run(trained[0], tmp_path / "o"), trained[1]
    ckpts = checkpoint.list_checkpoints(out)
    assert [checkpoint.step_of(p) for p in ckpts][-4:] == [10, 12, 14, 16], ckpts
    crafted, flipped, truncated, intact = ckpts[-1], ckpts[-2], ckpts[-3], ckpts[-4]
    pwned = tmp_path / "PWNED"
    write_with_digest(crafted, pickle.dumps({"model": Payload(pwned)}, protocol=4))
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:1000])

    proc = run_single([*args, "--output-dir", str(out), "--resume", "auto"], tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, explain(proc)
    assert not pwned.exists(), "the crafted checkpoint ran its payload"
    assert "refused to load posix.system" in one_line(text, f"warning: {crafted}:")
    assert "does not match" in one_line(text, f"warning: {flipped}:")
    assert "truncated" in one_line(text, f"warning: {truncated}:")
    assert f"resumed from {intact}: epoch 2, batch 2, step 10" in text
    for bad in (crafted, flipped, truncated):  # set aside, never deleted
        assert (bad.parent / (bad.name + checkpoint.ASIDE_SUFFIX)).is_file()
    assert checkpoint.step_of(checkpoint.list_checkpoints(out)[-1]) == 16  # the run went on to the end
    checkpoint.load(checkpoint.list_checkpoints(out)[-1])


@pytest.mark.slow
def test_resume_with_no_intact_checkpoint_stops_listing_them_and_overwrites_nothing(tmp_path, trained):
    out, args = copy_run(trained[0], tmp_path / "o"), trained[1]
    for path in checkpoint.list_checkpoints(out):
        path.write_bytes(path.read_bytes()[:1000])
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    proc = run_single([*args, "--output-dir", str(out), "--resume", "auto"], tmp_path)
    assert proc.returncode == 2, explain(proc)
    line = one_line(proc.stdout + proc.stderr, "error:")
    assert "no intact checkpoint" in line and "nothing was overwritten" in line, line
    for step in (10, 12, 14, 16):
        assert f"step_{step:08d}.pdckpt" in line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_crafted_weights_file_is_refused_by_the_loader_before_its_payload_runs(tmp_path):
    pwned, path = tmp_path / "PWNED", tmp_path / "model.pdparams"
    path.write_bytes(pickle.dumps({"conv.weight": Payload(pwned)}, protocol=4))
    with pytest.raises(checkpoint.CheckpointError, match=r"model\.pdparams: refused to load posix\.system"):
        checkpoint.load(path)
    assert not pwned.exists()


def limit_file_size(limit: int):
    def apply() -> None:  # in the child: the kernel refuses to grow any file past limit bytes (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def launch(args: list[str], tmp_path: Path, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """Two workers under the launcher (logs in tmp_path/log), each file they write limited to file_size_limit."""
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2"]
    cmd += ["--log_dir", str(tmp_path / "log"), str(TRAIN_PY), *args]
    limit = limit_file_size(file_size_limit) if file_size_limit else None
    return subprocess.run(
        cmd, cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=300, preexec_fn=limit
    )


def check_both_ranks_stopped(proc: subprocess.CompletedProcess, log_dir: Path, failed: Path, reason: str, good: Path):
    """Rank 0's one line names the file, the system's reason and the intact checkpoint; rank 1 stops with it."""
    assert proc.returncode != 0, explain(proc, log_dir)
    line = one_line(worker_log(log_dir, 0), "error:")
    assert f"cannot write {failed}: {reason}" in line, line
    assert f"the last good checkpoint {good} is intact" in line and "--resume auto" in line, line
    assert "rank 0 could not write" in one_line(worker_log(log_dir, 1), "error:")
    assert "Traceback" not in worker_log(log_dir, 0) + worker_log(log_dir, 1)
    assert not [p for p in failed.parent.rglob("*") if ".tmp" in p.name]
    checkpoint.load(good)  # intact: its digest matches


@pytest.mark.slow
def test_failed_checkpoint_write_stops_every_rank_with_one_line_and_keeps_the_last_good_one(tmp_path, trained):
    """A file-size limit makes the kernel refuse the write (EFBIG) exactly where a full disk refuses it (ENOSPC),
    without root or a mount: both are an OSError from write(2) on the checkpoint's temporary file."""
    out, args = copy_run(trained[0], tmp_path / "o"), trained[1]
    last_good = checkpoint.list_checkpoints(out)[-1]
    args = [*args, "--output-dir", str(out), "--resume", "auto", "--epochs", "3"]
    proc = launch(args, tmp_path, file_size_limit=last_good.stat().st_size // 2)
    failed = checkpoint.checkpoint_path(out, 24)
    check_both_ranks_stopped(proc, tmp_path / "log", failed, "File too large (EFBIG)", last_good)
    assert not failed.exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["metrics.jsonl", "model.pdparams", "results.json"])
def test_failed_write_of_metrics_weights_or_results_stops_every_rank_with_one_line(tmp_path, trained, name):
    """metrics.jsonl is a link to /dev/full, whose writes fail as a full disk's do (ENOSPC), and the run goes on
    to a third epoch; the weights are written under a file-size limit (EFBIG) and a folder stands where
    results.json goes (EISDIR) while the finished run is resumed (--resume yes), which writes both again."""
    out = copy_run(trained[0], tmp_path / "o")
    args = [*trained[1], "--output-dir", str(out)]
    last_good, target = checkpoint.list_checkpoints(out)[-1], out / name
    before = target.read_bytes()
    limit = None
    if name == "metrics.jsonl":
        target.unlink()
        target.symlink_to("/dev/full")
        args, reason = [*args, "--resume", "auto", "--epochs", "3"], "No space left on device (ENOSPC)"
    elif name == "model.pdparams":
        args, reason, limit = [*args, "--resume", "yes"], "File too large (EFBIG)", len(before) // 2
    else:
        target.unlink()
        target.mkdir()
        args, reason = [*args, "--resume", "yes"], "Is a directory (EISDIR)"
    proc = launch(args, tmp_path, file_size_limit=limit)
    check_both_ranks_stopped(proc, tmp_path / "log", target, reason, last_good)
    if name == "model.pdparams":
        assert target.read_bytes() == before  # the earlier weights, untouched
