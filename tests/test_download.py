"""python -m paddle_mnist.download run as users run it, against a local HTTP server on 127.0.0.1 (or a closed port)."""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from helpers import explain, free_port, launch_env, make_dataset, make_images, write_idx

from paddle_mnist.datasets.data import CIFAR_ARCHIVE, MNIST_JSON, REPO_DATA
from paddle_mnist.datasets.download import IDX_NAMES as IDX
from paddle_mnist.datasets.download import SUMS
from paddle_mnist.datasets.formats import read_idx, read_mnist_json

pytestmark = pytest.mark.slow  # every test runs the command in a new process

PUBLISHED_MNIST_MD5 = (
    "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "d53e105ee54ea40749a09fcbcd1e9432",
    "9fb629c4189551a2d022fa330f9573f3",
    "ec29112dd5afa0611ce80d1b7f02629c",
)


@dataclass
class Served:
    root: Path
    url: str
    requests: list[str] = field(default_factory=list)  # paths asked for, in order
    broken: set[str] = field(default_factory=set)  # files whose connection closes halfway


class Handler(SimpleHTTPRequestHandler):
    def do_GET(self):
        served: Served = self.server.served
        name = self.path.lstrip("/")
        served.requests.append(name)
        if name in served.broken:  # announce the whole file, send half of it, hang up
            data = (served.root / name).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    httpd.served = Served(root, f"http://127.0.0.1:{httpd.server_address[1]}")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.served
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def closed_port_url() -> str:
    """A loopback URL nothing listens on, so the connection is refused."""
    return f"http://127.0.0.1:{free_port()}"


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "paddle_mnist.download", *args]
    return subprocess.run(cmd, cwd=cwd, env=launch_env(), capture_output=True, text=True, timeout=120)


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def write_md5s(folder: Path, to: Path) -> Path:
    """A --checksums file holding the MD5s of the files we serve, standing in for the published ones."""
    to.write_text("".join(f"{md5(folder / n)}  {n}\n" for n in IDX))
    return to


def test_fetches_verifies_places_then_skips(server, tmp_path):
    make_dataset(server.root, n_train=64, n_test=32, checksums=False)
    sums = write_md5s(server.root, tmp_path / "md5s")
    dest = tmp_path / "dest"
    args = ["mnist", "--data-dir", str(dest), "--mirror", server.url, "--checksums", str(sums)]
    proc = run(args, cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert sorted(p.name for p in dest.iterdir()) == sorted([*IDX, SUMS])  # no .partial left
    for name in IDX:
        assert (dest / name).read_bytes() == (server.root / name).read_bytes()
        assert f"{name}: fetched" in proc.stdout and f"{server.url}/{name}" in proc.stdout
    listed = dict(reversed(line.split("  ")) for line in (dest / SUMS).read_text().splitlines())
    assert listed == {n: hashlib.sha256((dest / n).read_bytes()).hexdigest() for n in IDX}
    assert read_idx(dest / IDX[0], 3).shape == (64, 28, 28)
    assert read_idx(dest / IDX[3], 1).shape == (32,)

    before = {n: (dest / n).stat().st_mtime_ns for n in IDX}
    server.requests.clear()
    again = run(args, cwd=tmp_path)
    assert again.returncode == 0, explain(again)
    assert again.stdout.count("verified; skipped") == 4
    assert server.requests == []
    assert {n: (dest / n).stat().st_mtime_ns for n in IDX} == before


def test_checksum_mismatch_keeps_nothing_bad_and_never_replaces_a_good_file(server, tmp_path):
    make_dataset(server.root, n_train=64, n_test=32, checksums=False)
    sums = write_md5s(server.root, tmp_path / "md5s")
    dest = tmp_path / "dest"
    dest.mkdir()
    good_labels = dest / IDX[1]
    shutil.copy(server.root / IDX[1], good_labels)
    good_bytes, good_mtime = good_labels.read_bytes(), good_labels.stat().st_mtime_ns
    # the server now holds other images and other labels than the checksums promise
    other_images, other_labels = make_images(64, seed=7)
    write_idx(server.root / "train-images-idx3-ubyte", other_images)
    write_idx(server.root / "train-labels-idx1-ubyte", other_labels)
    want, got = sums.read_text().split()[0], md5(server.root / IDX[0])

    proc = run(["mnist", "--data-dir", str(dest), "--mirror", server.url, "--checksums", str(sums)], cwd=tmp_path)
    assert proc.returncode == 1, explain(proc)
    assert IDX[0] in proc.stderr and want in proc.stderr and got in proc.stderr
    assert str(dest / IDX[0]) in proc.stderr  # and where a good copy belongs
    assert IDX[1] not in server.requests  # verified in place, so never fetched again
    assert sorted(p.name for p in dest.iterdir()) == sorted([IDX[1], IDX[2], IDX[3]])  # no bad file, no .partial
    assert good_labels.read_bytes() == good_bytes and good_labels.stat().st_mtime_ns == good_mtime
    assert not (dest / SUMS).exists()


def test_broken_connection_leaves_no_partial_file(server, tmp_path):
    make_dataset(server.root, n_train=64, n_test=32, checksums=False)
    sums = write_md5s(server.root, tmp_path / "md5s")
    server.broken.add(IDX[2])
    dest = tmp_path / "dest"
    proc = run(["mnist", "--data-dir", str(dest), "--mirror", server.url, "--checksums", str(sums)], cwd=tmp_path)
    assert proc.returncode == 1, explain(proc)
    assert "connection broke" in proc.stderr and IDX[2] in proc.stderr
    assert sorted(p.name for p in dest.iterdir()) == sorted([IDX[0], IDX[1], IDX[3]])


def test_offline_says_which_files_to_put_where_and_writes_nothing(tmp_path):
    dest = tmp_path / "dest"
    proc = run(["mnist", "--data-dir", str(dest), "--mirror", closed_port_url(), "--timeout", "5"], cwd=tmp_path)
    assert proc.returncode == 1, explain(proc)
    assert "cannot reach" in proc.stderr and "on a machine with network" in proc.stderr
    for name, digest in zip(IDX, PUBLISHED_MNIST_MD5):
        assert name in proc.stderr and digest in proc.stderr and str(dest / name) in proc.stderr
    assert not dest.exists()
    assert proc.stderr.count("\n") < 30  # one message, not a traceback


def test_offline_default_destination_is_where_the_trainer_looks(tmp_path):
    target = REPO_DATA / "cifar10" / CIFAR_ARCHIVE
    if target.exists():
        pytest.skip(f"{target} is already there")
    proc = run(["cifar10", "--mirror", closed_port_url(), "--timeout", "5"], cwd=tmp_path)  # another cwd on purpose
    assert proc.returncode == 1, explain(proc)
    assert str(target) in proc.stderr and "c58f30108f718f92721af3b95e74349a" in proc.stderr
    assert not target.exists()


@pytest.mark.parametrize("dataset", ["fashion-mnist", "mnist"])
def test_shipped_dataset_is_already_in_place(tmp_path, dataset):
    """The shipped copies are re-compressed (Debian's Fashion-MNIST, our MNIST): they fail the published MD5s but
    match the shipped SHA256SUMS, so there is nothing to fetch."""
    folder = REPO_DATA / dataset
    before = sorted(p.name for p in folder.iterdir())
    proc = run([dataset, "--mirror", closed_port_url()], cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert "already in place" in proc.stdout
    assert sorted(p.name for p in folder.iterdir()) == before


def test_builds_mnist_json_with_the_course_split(server, tmp_path):
    make_dataset(server.root, n_train=10_100, n_test=50, checksums=False)
    sums = write_md5s(server.root, tmp_path / "md5s")
    dest = tmp_path / "dest"
    args = ["mnist-json", "--data-dir", str(dest), "--mirror", server.url, "--checksums", str(sums)]
    proc = run(args, cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert sorted(p.name for p in dest.iterdir()) == sorted([SUMS, MNIST_JSON])
    built = dest / MNIST_JSON
    assert (dest / SUMS).read_text() == f"{hashlib.sha256(built.read_bytes()).hexdigest()}  {MNIST_JSON}\n"

    tree = json.loads(gzip.decompress(built.read_bytes()))
    train_x, train_y = read_idx(server.root / IDX[0], 3), read_idx(server.root / IDX[1], 1)
    test_x, test_y = read_idx(server.root / IDX[2], 3), read_idx(server.root / IDX[3], 1)
    want = [(train_x[:100], train_y[:100]), (train_x[100:], train_y[100:]), (test_x, test_y)]
    assert isinstance(tree, list) and len(tree) == 3
    for (images, labels), (want_x, want_y) in zip(tree, want):
        assert all(type(v) is int for v in labels) and labels == want_y.tolist()
        assert {len(row) for row in images} == {784}
        pixels = np.asarray(images, dtype=np.float64)
        assert pixels.min() >= 0.0 and pixels.max() <= 1.0
        assert np.array_equal(np.rint(pixels * 255).astype(np.uint8), want_x.reshape(len(want_x), 784))
    parts = read_mnist_json(built)  # and the trainer's reader takes it
    assert [len(parts[s][1]) for s in ("train", "valid", "eval")] == [100, 10_000, 50]

    server.requests.clear()
    again = run(args, cwd=tmp_path)
    assert again.returncode == 0 and "already built" in again.stdout, explain(again)
    assert server.requests == []


def test_mnist_json_is_built_offline_from_the_shipped_mnist(tmp_path):
    dest = tmp_path / "dest"
    proc = run(["mnist-json", "--data-dir", str(dest)], cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert f"using the MNIST files in {REPO_DATA / 'mnist'}" in proc.stdout
    parts = read_mnist_json(dest / MNIST_JSON)
    shipped = {split: read_idx(REPO_DATA / "mnist" / IDX[i], 1) for split, i in (("train", 1), ("t10k", 3))}
    assert [len(parts[s][1]) for s in ("train", "valid", "eval")] == [50_000, 10_000, 10_000]
    assert np.array_equal(np.concatenate([parts["train"][1], parts["valid"][1]]), shipped["train"])
    assert np.array_equal(parts["eval"][1], shipped["t10k"])
    assert np.array_equal(parts["valid"][0][:, 0], read_idx(REPO_DATA / "mnist" / IDX[0], 3)[50_000:])


def test_workers_that_start_together_build_mnist_json_once(tmp_path):
    """What the trainer does with --dataset mnist-json and no file yet: every worker asks, the first one builds."""
    folder = tmp_path / "mnist-json"
    code = "import pathlib, paddle_mnist.datasets.download as d; "
    code += f"d.build_shipped_mnist_json(pathlib.Path({str(folder)!r}))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=launch_env(), stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "".join(outs).count("built ") == 1
    assert sorted(p.name for p in folder.iterdir()) == sorted([".build.lock", MNIST_JSON, SUMS])
    assert (
        folder / SUMS
    ).read_text() == f"{hashlib.sha256((folder / MNIST_JSON).read_bytes()).hexdigest()}  {MNIST_JSON}\n"


def test_unknown_dataset_is_a_usage_error(tmp_path):
    proc = run(["svhn"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr and "invalid choice: 'svhn'" in proc.stderr
