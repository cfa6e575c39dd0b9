"""The input side (data, formats, augment): formats load or name their damage, pickles run no code, shards are exact."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import (
    REPO,
    cifar_batch_bytes,
    cifar_members,
    explain,
    idx_bytes,
    make_colour_images,
    make_dataset,
    make_images,
    mnist_json_tree,
    read_metrics,
    read_results,
    run_launch,
    run_single,
    worker_log,
    write_cifar_archive,
    write_cifar_folder,
    write_idx,
    write_mnist_json,
)
from PIL import Image

from paddle_mnist.datasets import augment, data, formats

ARCHIVE = data.CIFAR_ARCHIVE


# ---- CIFAR-10 ----


@pytest.mark.parametrize("layout", ["archive", "archive file", "extracted", "extracted folder"])
def test_cifar10_loads_from_the_archive_or_the_extracted_folder(tmp_path, layout):
    members = cifar_members(n_per_batch=20, n_test=15)
    if layout.startswith("archive"):
        path = write_cifar_archive(tmp_path / ARCHIVE, members)
    else:
        path = write_cifar_folder(tmp_path / "cifar-10-batches-py", members)
    ds = data.load_dataset("cifar10", str(path if layout.endswith(("file", "folder")) else tmp_path))
    assert ds.train.images.shape == (100, 3, 32, 32) and ds.train.images.dtype == np.uint8
    assert ds.test.images.shape == (15, 3, 32, 32) and ds.val_is_test
    assert ds.classes[0] == "airplane" and len(ds.classes) == 10
    # batch i's images land in rows 20(i-1)..20i-1, channel-first as the archive stores them
    images, labels = make_colour_images(20, seed=3)
    np.testing.assert_array_equal(ds.train.images[40:60], images)
    np.testing.assert_array_equal(ds.train.labels[40:60], labels)


def test_cifar10_statistics_are_per_channel_from_the_training_split(tmp_path):
    write_cifar_archive(tmp_path / ARCHIVE, cifar_members(n_per_batch=20, n_test=15))
    ds = data.load_dataset("cifar10", str(tmp_path))
    pixels = ds.train.images.astype(np.float64) / 255
    np.testing.assert_allclose(ds.mean, pixels.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(ds.std, pixels.std(axis=(0, 2, 3)), rtol=1e-9)
    x = data.normalise(ds.train.images, ds.mean, ds.std)
    assert x.dtype == np.float32
    np.testing.assert_allclose(x.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(x.std(axis=(0, 2, 3)), 1, atol=1e-5)


def damaged_cifar(kind: str) -> dict[str, bytes]:
    members = cifar_members(n_per_batch=20, n_test=15)
    images, labels = make_colour_images(20, seed=2)
    if kind == "missing member":
        del members["data_batch_4"]
    elif kind == "wrong row length":
        members["data_batch_2"] = pickle.dumps({b"data": images.reshape(20, -1)[:, :3000], b"labels": labels}, 2)
    elif kind == "wrong dtype":
        members["data_batch_2"] = cifar_batch_bytes(images, labels)
        batch = pickle.loads(members["data_batch_2"])
        batch[b"data"] = batch[b"data"].astype(np.float32)
        members["data_batch_2"] = pickle.dumps(batch, 2)
    elif kind == "label out of range":
        members["data_batch_2"] = cifar_batch_bytes(images, [10] + list(labels[1:]))
    elif kind == "labels short":
        members["data_batch_2"] = cifar_batch_bytes(images, labels[:19])
    elif kind == "uneven batches":
        members["data_batch_5"] = cifar_batch_bytes(images[:7], labels[:7])
    elif kind == "no labels entry":
        members["test_batch"] = pickle.dumps({b"data": images.reshape(20, -1)}, 2)
    elif kind == "not a dict":
        members["test_batch"] = pickle.dumps([1, 2, 3], 2)
    elif kind == "damaged pickle":
        members["data_batch_1"] = members["data_batch_1"][:5000]
    elif kind == "empty batch file":
        members["data_batch_1"] = b""
    elif kind == "no class names":
        members["batches.meta"] = pickle.dumps({b"num_vis": 3072}, 2)
    return members


CIFAR_DAMAGE = {
    "missing member": "no member cifar-10-batches-py/data_batch_4",
    "wrong row length": "rows hold 3000 values, want 3072",
    "wrong dtype": "'data' is a float32 array",
    "label out of range": "label 10 is outside 0..9",
    "labels short": "20 images but 19 labels",
    "uneven batches": "data_batch_5: 7 images, but .*data_batch_1 has 20",
    "no labels entry": "test_batch: no 'labels' entry",
    "not a dict": "test_batch: holds a list",
    "damaged pickle": "data_batch_1: not a readable CIFAR-10 batch",
    "empty batch file": "data_batch_1: not a readable CIFAR-10 batch",
    "no class names": "batches.meta: want 'label_names'",
}


@pytest.mark.parametrize("kind", sorted(CIFAR_DAMAGE))
def test_damaged_cifar10_archive_names_the_file_and_the_problem(tmp_path, kind):
    path = write_cifar_archive(tmp_path / ARCHIVE, damaged_cifar(kind))
    with pytest.raises(data.DataError, match=CIFAR_DAMAGE[kind]) as err:
        data.load_dataset("cifar10", str(tmp_path))
    assert str(path) in str(err.value)


def test_damaged_extracted_folder_names_the_batch_file(tmp_path):
    folder = write_cifar_folder(tmp_path / "cifar-10-batches-py", damaged_cifar("labels short"))
    with pytest.raises(data.DataError, match="data_batch_2: 20 images but 19 labels") as err:
        data.load_dataset("cifar10", str(tmp_path))
    assert str(folder / "data_batch_2") in str(err.value)
    (folder / "test_batch").unlink()
    (folder / "data_batch_2").write_bytes(cifar_members(20, 15)["data_batch_2"])
    with pytest.raises(data.DataError, match="test_batch: missing"):
        data.load_dataset("cifar10", str(tmp_path))


@pytest.mark.parametrize("cut", ["truncated", "empty"])
def test_truncated_or_empty_archive_is_refused(tmp_path, cut):
    path = write_cifar_archive(tmp_path / ARCHIVE, cifar_members(n_per_batch=20, n_test=15))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if cut == "truncated" else b"")
    with pytest.raises(data.DataError, match=f"{path}: .*download it again"):
        data.load_dataset("cifar10", str(tmp_path))


def test_no_cifar_files_says_how_to_get_them(tmp_path):
    want = r"neither cifar-10-python\.tar\.gz nor cifar-10-batches-py/.*python -m paddle_mnist\.download cifar10"
    with pytest.raises(data.DataError, match=want):
        data.load_dataset("cifar10", str(tmp_path))


def class_folders(root):
    """A tiny --dataset folder tree, as the CIFAR-10 JPEG copy is laid out: root/train/<class>/*.jpg."""
    images, _ = make_colour_images(4, seed=5)
    for i, name in enumerate(("airplane", "automobile", "airplane", "automobile")):
        (root / "train" / name).mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i].transpose(1, 2, 0)).save(root / "train" / name / f"{i}.jpg")
    return root


@pytest.mark.parametrize(("name", "files"), [("cifar10", "CIFAR-10's python batches"), ("mnist", "MNIST's idx files")])
def test_class_folders_given_to_a_built_in_dataset_name_dataset_folder(tmp_path, name, files):
    root = class_folders(tmp_path / "cifar")
    want = f"{root} holds class folders (train/airplane/...), not {files}: pass --dataset folder --data-dir {root}"
    with pytest.raises(data.DataError, match=re.escape(want) + "$"):
        data.load_dataset(name, str(root))


@pytest.mark.slow
def test_cifar10_on_class_folders_stops_before_training_and_names_dataset_folder(tmp_path):
    root = class_folders(tmp_path / "cifar")
    proc = run_single(["--dataset", "cifar10", "--data-dir", str(root), "--output-dir", "out"], cwd=tmp_path)
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].endswith(f"pass --dataset folder --data-dir {root}"), explain(proc)
    assert "python -m paddle_mnist.download" not in proc.stdout and not (tmp_path / "out").exists()


class _RunsCode:
    """A pickle payload: unpickling it calls os.system, which would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_a_pickle_that_would_run_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({b"data": _RunsCode(marker), b"labels": [0]}, protocol=2)
    # the payload is real: a plain pickle.loads runs it (in a child process, which we throw away)
    probe = tmp_path / "probe"
    plain = pickle.dumps(_RunsCode(probe), protocol=2)
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.loads({plain!r})"], check=True)
    assert probe.exists()

    members = cifar_members(n_per_batch=20, n_test=15)
    members["data_batch_3"] = payload
    write_cifar_archive(tmp_path / ARCHIVE, members)
    with pytest.raises(data.DataError, match=r"data_batch_3: refused to load (posix|os)\.system"):
        data.load_dataset("cifar10", str(tmp_path))
    assert not marker.exists()


@pytest.mark.parametrize(
    "module,name", [("builtins", "eval"), ("subprocess", "Popen"), ("numpy", "load"), ("_codecs", "decode")]
)
def test_only_the_array_reconstruction_globals_are_admitted(module, name):
    class Global:
        def __reduce__(self):
            return (getattr(__import__(module), name), ("x",))

    # protocol 2 writes Python 2's module names (builtins -> __builtin__), so only the function name is fixed
    with pytest.raises(data.DataError, match=rf"refused to load [\w.]+\.{name}:"):
        formats.safe_unpickle(pickle.dumps(Global(), protocol=2), "batch")


# ---- the shipped MNIST ----

PUBLISHED_COUNTS = {  # images per digit 0..9, as published with MNIST
    "train": [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
    "test": [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009],
}


def test_shipped_mnist_loads_with_the_published_label_counts():
    ds = data.load_dataset("mnist")
    for split, got in (("train", ds.train), ("test", ds.test)):
        assert got.images.shape[1:] == (1, 28, 28)
        assert np.bincount(got.labels, minlength=10).tolist() == PUBLISHED_COUNTS[split]
    assert ds.classes == data.DIGITS
    assert round(ds.mean[0], 4) == 0.1307 and round(ds.std[0], 4) == 0.3081  # the figures every MNIST example uses


# ---- mnist.json.gz ----


@pytest.mark.parametrize("signed", [False, True], ids=["0..1", "-1..1"])
def test_mnist_json_keeps_its_validation_split(tmp_path, signed):
    path = write_mnist_json(tmp_path / "mnist.json.gz", mnist_json_tree((120, 40, 30), signed=signed))
    ds = data.load_dataset("mnist-json", str(tmp_path))
    assert (len(ds.train), len(ds.val), len(ds.test)) == (120, 40, 30) and not ds.val_is_test
    assert ds.train.images.shape == (120, 1, 28, 28) and ds.train.images.dtype == np.uint8
    images, labels = make_images(40, seed=6)  # the valid split; floats round back to the original bytes
    np.testing.assert_array_equal(ds.val.images[:, 0], images)
    np.testing.assert_array_equal(ds.val.labels, labels)
    assert data.load_dataset("mnist-json", str(path)).train.images.sum() == ds.train.images.sum()


def test_mnist_json_with_any_json_spacing_reads_the_same(tmp_path):
    tree = mnist_json_tree((20, 10, 10))
    compact = write_mnist_json(tmp_path / "a" / "mnist.json.gz", tree)
    spaced = tmp_path / "b" / "mnist.json.gz"
    spaced.parent.mkdir()
    spaced.write_bytes(gzip.compress(("\n " + json.dumps(tree, indent=1) + " \n").encode()))
    a, b = formats.read_mnist_json(compact), formats.read_mnist_json(spaced)
    for name in formats.MNIST_JSON_SPLITS:
        np.testing.assert_array_equal(a[name][0], b[name][0])
        np.testing.assert_array_equal(a[name][1], b[name][1])


def damaged_json(kind: str) -> bytes:
    tree = mnist_json_tree((20, 10, 10))
    if kind == "two splits":
        tree = tree[:2]
    elif kind == "783 pixels":
        tree[0][0][3] = tree[0][0][3][:-1]
    elif kind == "pixel out of range":
        tree[1][0][0][5] = 3.5
    elif kind == "labels short":
        tree[2][1] = tree[2][1][:-1]
    elif kind == "label out of range":
        tree[0][1][0] = 11
    elif kind == "label not a number":
        tree[0][1][0] = "7"
    elif kind == "four splits":
        tree.append(tree[0])
    elif kind == "image not a list":
        tree[1][0][2] = 0.5
    raw = gzip.compress(json.dumps(tree).encode())
    if kind == "truncated gzip":
        return raw[:-30]
    if kind == "not json":
        return gzip.compress(b"[[[[0.1, 0.2, ")
    if kind == "a pickle":
        return gzip.compress(pickle.dumps(tree))
    return raw


JSON_DAMAGE = {
    "two splits": "want a JSON list \\[train, valid, eval\\]",
    "783 pixels": "train split.*784",
    "pixel out of range": "valid split.*pixel values must lie in",
    "labels short": "eval split.*10 images but 9 labels",
    "label out of range": "label 11 is outside 0..9",
    "label not a number": "labels must be a list of integers",
    "four splits": "found more than three splits",
    "image not a list": "valid split.*image 2 has float values, want 784",
    "truncated gzip": "cannot read it",
    "not json": "not valid JSON",
    "a pickle": "not valid JSON",
}


@pytest.mark.parametrize("kind", sorted(JSON_DAMAGE))
def test_damaged_mnist_json_names_the_file_and_the_problem(tmp_path, kind):
    path = tmp_path / "mnist.json.gz"
    path.write_bytes(damaged_json(kind))
    with pytest.raises(data.DataError, match=JSON_DAMAGE[kind]) as err:
        data.load_dataset("mnist-json", str(tmp_path))
    assert str(path) in str(err.value)


def test_empty_idx_file_is_refused(tmp_path):
    make_dataset(tmp_path, n_train=30, n_test=7, checksums=False)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(b"")
    with pytest.raises(data.DataError, match="train-labels-idx1-ubyte.gz: 0 bytes is too short"):
        data.load_dataset("mnist", str(tmp_path))


# ---- idx files, checksums, the shipped datasets ----


@pytest.mark.parametrize("compress", [True, False])
def test_idx_files_load_gzipped_or_plain(tmp_path, compress):
    make_dataset(tmp_path, n_train=30, n_test=7, compress=compress)
    split = data.load_split(tmp_path, "test")
    assert split.images.shape == (7, 1, 28, 28) and split.images.dtype == np.uint8
    assert split.labels.dtype == np.int64 and len(split) == 7


def test_wrong_magic_number_names_the_file(tmp_path):
    raw = bytearray(idx_bytes(np.zeros((3, 28, 28), np.uint8)))
    raw[3] = 2
    with pytest.raises(data.DataError, match="wrong magic number"):
        formats.parse_idx(bytes(raw), tmp_path / "x", 3)


def test_truncated_file_is_refused(tmp_path):
    raw = idx_bytes(np.zeros((3, 28, 28), np.uint8))
    with pytest.raises(data.DataError, match="header promises"):
        formats.parse_idx(raw[:-5], tmp_path / "x", 3)


def test_truncated_gzip_is_refused(tmp_path):
    make_dataset(tmp_path, n_train=30, n_test=7)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-20])
    (tmp_path / "SHA256SUMS").unlink()
    with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz"):
        data.load_split(tmp_path, "test")


def test_label_count_must_match_image_count(tmp_path):
    make_dataset(tmp_path, n_train=30, n_test=7)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(6, np.uint8))
    with pytest.raises(data.DataError, match="7 images but 6 labels"):
        data.load_split(tmp_path, "test")


def test_checksum_mismatch_is_refused(tmp_path):
    make_dataset(tmp_path, n_train=30, n_test=7)
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.ones(7, np.uint8))))
    with pytest.raises(data.DataError, match="SHA-256 does not match"):
        data.load_dataset("mnist", str(tmp_path))


def test_shipped_fashion_mnist_is_intact():
    ds = data.load_dataset("fashion-mnist")
    assert (len(ds.train), len(ds.test)) == (60000, 10000)
    assert np.bincount(ds.test.labels).tolist() == [1000] * 10
    assert (REPO / "data" / "fashion-mnist" / "LICENSE").is_file()


def test_normalise_uses_the_training_statistics():
    ds = data.load_dataset("fashion-mnist")
    x = data.normalise(ds.train.images[:20000], ds.mean, ds.std)
    assert x.shape == (20000, 1, 28, 28) and x.dtype == np.float32
    assert abs(float(x.mean())) < 0.02 and abs(float(x.std()) - 1) < 0.02


def test_datasets_are_read_from_the_checkouts_data_folder():
    """Run from a checkout (pyproject.toml beside the package), the default is the shipped data/ there."""
    assert data.REPO_DATA == REPO / "data" and (data.REPO_DATA / "fashion-mnist" / data.SUMS).is_file()


# ---- augmentation ----


def test_augmentation_is_a_shift_and_maybe_a_flip_of_each_image():
    images = np.random.RandomState(0).randint(1, 256, size=(64, 3, 32, 32)).astype(np.uint8)
    policy = augment.POLICIES["cifar10"]
    out = augment.shift_and_flip(images, policy, augment.batch_rng(1, 0, 0))
    assert out.shape == images.shape and out.dtype == np.uint8
    padded = np.pad(images, ((0, 0), (0, 0), (4, 4), (4, 4)))
    offsets, flips = set(), 0
    for i in range(64):
        found = [
            (dy, dx, flip)
            for dy in range(9)
            for dx in range(9)
            for flip in (False, True)
            if np.array_equal(out[i], (lambda w: w[..., ::-1] if flip else w)(padded[i, :, dy : dy + 32, dx : dx + 32]))
        ]
        assert len(found) == 1, f"image {i} is not one shifted (and maybe flipped) copy of its source"
        offsets.add(found[0][:2])
        flips += found[0][2]
    assert len(offsets) > 20 and 16 < flips < 48  # offsets spread over the 81, about half flipped


def test_augmentation_is_reproducible_and_differs_by_epoch_and_batch():
    images = np.random.RandomState(0).randint(0, 256, size=(32, 3, 32, 32)).astype(np.uint8)
    policy = augment.POLICIES["cifar10"]

    def draw(seed, epoch, batch):
        return augment.shift_and_flip(images, policy, augment.batch_rng(seed, epoch, batch))

    np.testing.assert_array_equal(draw(42, 3, 7), draw(42, 3, 7))
    for other in ((43, 3, 7), (42, 4, 7), (42, 3, 8)):
        assert not np.array_equal(draw(*other), draw(42, 3, 7)), other


PHOTO = augment.Augment(pad=0, flip=True, crop_scale=0.35, jitter=0.4, erase=0.25)  # --augment photo's


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("policy", [augment.POLICIES["cifar10"], PHOTO])
def test_each_workers_share_is_augmented_as_one_process_augments_the_global_batch(workers, policy):
    """N workers then train on the images one process would: the same shift and flip for every image."""
    images = np.random.RandomState(1).randint(0, 256, size=(96, 3, 32, 32)).astype(np.uint8)
    whole = augment.augment_batch(images, policy, augment.batch_rng(7, 2, 5))
    n = 96 // workers
    for rank in range(workers):
        part = images[rank * n : rank * n + n]
        share = augment.augment_batch(part, policy, augment.batch_rng(7, 2, 5), rank * n, 96)
        np.testing.assert_array_equal(share, whole[rank * n : rank * n + n])
    alone = augment.augment_batch(images[n : 2 * n], policy, augment.batch_rng(7, 2, 5))  # draws of its own
    assert not np.array_equal(alone, whole[n : 2 * n])


def test_digits_are_shifted_but_never_mirrored():
    images = np.zeros((200, 1, 28, 28), np.uint8)
    images[:, 0, 10:18, 3] = 255  # a bar near the left edge: a mirror would move it past the middle
    out = augment.shift_and_flip(images, augment.POLICIES["mnist"], augment.batch_rng(0, 0, 0))
    columns = out.max(axis=(1, 2)).argmax(axis=1)
    assert set(columns.tolist()) == {1, 2, 3, 4, 5}


@pytest.mark.parametrize("policy", [augment.POLICIES["cifar10"], PHOTO])
def test_batches_resume_mid_epoch_with_the_same_augmentation(policy):
    split = data.Split(*make_colour_images(40, seed=1))
    ds = data.Dataset("cifar10", split, split, split, (0.5,) * 3, (0.25,) * 3, tuple("abcdefghij"))
    plan = data.AugmentPlan(policy, seed=5, epoch=2, rank=1, world_size=2)
    index_batches = [np.arange(k * 8, k * 8 + 8) for k in range(5)]
    whole = list(data.batches(split, ds, index_batches, plan))
    resumed = list(data.batches(split, ds, index_batches[3:], plan, first=3))
    for a, b in zip(whole[3:], resumed):
        np.testing.assert_array_equal(a[0], b[0])
    plain = next(data.batches(split, ds, index_batches[:1]))[0]
    np.testing.assert_array_equal(plain, data.normalise(split.images[:8], ds.mean, ds.std))
    assert not np.array_equal(plain, whole[0][0])


def test_a_resized_crop_zooms_into_a_part_of_the_image_and_a_whole_square_crop_is_the_image():
    ramp = np.tile((np.arange(64) * 4).astype(np.uint8), (200, 3, 48, 1))  # each row 0, 4, ..., 252 left to right
    every = slice(0, 200)
    out = augment.resized_crops(ramp, 0.35, np.random.default_rng(0), every, 200)
    assert out.shape == ramp.shape and out.dtype == np.uint8
    steps = np.diff(out[:, 0].astype(int), axis=-1)
    assert (steps >= 0).all() and (out[:, :, 1:] == out[:, :, :1]).all()  # still one ramp, rising to the right
    spans = out[:, 0, 0, -1].astype(int) - out[:, 0, 0, 0]  # what a row covers of the original's 252
    assert spans.max() <= 252 and spans.min() >= int(252 * np.sqrt(0.35) / np.sqrt(4 / 3)) - 8
    assert spans.mean() < 230 and len(set(spans.tolist())) > 50  # crops of many sizes, most smaller than the image
    images = np.random.default_rng(1).integers(0, 256, (16, 3, 32, 40), dtype=np.uint8)
    whole = augment.resized_crops(images, 1.0, np.random.default_rng(2), slice(0, 16), 16, ratio=1.0)
    np.testing.assert_array_equal(whole, images)  # all of the area at the image's own aspect: every pixel kept


def test_colour_jitter_scales_brightness_contrast_and_saturation_in_turn():
    images = np.random.default_rng(3).integers(0, 256, (32, 3, 24, 24), dtype=np.uint8)
    out = augment.colour_jitter(images, 0.4, np.random.default_rng(4), slice(0, 32), 32)
    draws = np.random.default_rng(4)
    b, c, s = (draws.uniform(0.6, 1.4, 32)[:, None, None, None] for _ in range(3))
    grey = lambda x: np.tensordot([0.299, 0.587, 0.114], x, axes=([0], [1]))[:, None]  # noqa: E731
    x = images * b
    x = (x - grey(x).mean(axis=(1, 2, 3), keepdims=True)) * c + grey(x).mean(axis=(1, 2, 3), keepdims=True)
    x = (x - grey(x)) * s + grey(x)
    expected = np.rint(np.clip(x, 0, 255))
    assert np.abs(out - expected).max() <= 1  # float32 against float64, one rounding apart at most
    grey_images = images[:, :1]
    plain = augment.colour_jitter(grey_images, 0.4, np.random.default_rng(4), slice(0, 32), 32)
    x = grey_images * b
    x = (x - x.mean(axis=(1, 2, 3), keepdims=True)) * c + x.mean(axis=(1, 2, 3), keepdims=True)
    assert np.abs(plain - np.rint(np.clip(x, 0, 255))).max() <= 1  # grey: no saturation to change


def test_random_erasing_paints_one_rectangle_of_one_colour_over_about_its_share_of_the_images():
    images = np.full((400, 3, 40, 40), 7, np.uint8)
    out = augment.erase_rectangles(images, 0.25, np.random.default_rng(5), slice(0, 400), 400)
    changed = [k for k in range(400) if not np.array_equal(out[k], images[k])]
    assert 70 < len(changed) < 130
    for k in changed:
        rows, cols = np.nonzero((out[k] != 7).any(axis=0))
        box = out[k][:, rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
        assert (box == box[:, :1, :1]).all()  # one rectangle of one colour
        assert 0.015 <= box[0].size / 1600 <= 0.3


def test_mixup_blends_each_image_with_its_partner_by_its_weight_and_labels_both():
    images = np.random.default_rng(6).integers(0, 256, (64, 3, 16, 16), dtype=np.uint8)
    labels = np.arange(64) % 10
    policy = augment.Augment(pad=0, flip=False, mixup=0.4)
    out, rows = augment.mix_pairs(images, labels, policy, np.random.default_rng(7))
    assert rows.dtype == np.float32 and rows.shape == (64, 3)
    partner = np.arange(64) ^ 1  # places 2j and 2j + 1
    np.testing.assert_array_equal(rows[:, :2], np.stack([labels, labels[partner]], axis=1))
    lam = rows[:, 2][:, None, None, None]
    expected = lam * images + (1 - lam) * images[partner].astype(np.float64)
    assert np.abs(out - np.rint(expected)).max() <= 1
    assert 0 < rows[:, 2].min() and rows[:, 2].max() < 1 and rows[:, 2].std() > 0.2  # Beta(0.4, 0.4): near 0 or 1


def test_cutmix_pastes_one_rectangle_of_the_partner_and_the_weight_is_the_part_of_its_own_pixels_left():
    images = np.stack([np.full((3, 20, 24), k, np.uint8) for k in range(40)])  # image k: every pixel k
    policy = augment.Augment(pad=0, flip=False, cutmix=1.0)
    out, rows = augment.mix_pairs(images, np.arange(40), policy, np.random.default_rng(8))
    for k in range(40):
        own = out[k] == k
        assert (own | (out[k] == k ^ 1)).all()  # its own pixels and its partner's only
        rows_, cols = np.nonzero(~own[0])
        if len(rows_):  # the partner's pixels form one rectangle
            assert (~own[0][rows_.min() : rows_.max() + 1, cols.min() : cols.max() + 1]).all()
        assert rows[k, 2] == pytest.approx(own[0].mean())


@pytest.mark.parametrize("workers", [2, 4])
def test_mixed_pairs_split_over_workers_as_one_process_mixes_them(workers):
    images = np.random.default_rng(9).integers(0, 256, (64, 3, 16, 16), dtype=np.uint8)
    labels = np.arange(64) % 10
    policy = augment.Augment(pad=1, flip=True, crop_scale=0.5, mixup=0.4, cutmix=1.0)

    def mixed(part, position, total):
        rng = augment.batch_rng(3, 1, 4)
        return augment.mix_pairs(
            augment.augment_batch(part, policy, rng, position, total), labels[position], policy, rng, position, total
        )

    whole = mixed(images, np.arange(64), 64)
    n = 64 // workers
    for rank in range(workers):
        places = data.worker_places(n, rank, workers, accum=2)  # two micro-batches a worker, each of whole pairs
        got = mixed(images[places], places, 64)
        np.testing.assert_array_equal(got[0], whole[0][places])
        np.testing.assert_array_equal(got[1], whole[1][places])
    with pytest.raises(ValueError, match="whole pairs"):
        augment.mix_pairs(images[1:5], labels[1:5], policy, augment.batch_rng(3, 1, 4), 1, 64)


def test_shift_zero_leaves_only_flips():
    policy = augment.policy_for("fashion-mnist", (1, 28, 28), 0)
    assert policy == augment.Augment(pad=0, flip=True) and augment.policy_for("cifar10", (3, 32, 32)).pad == 4
    images = np.random.default_rng(0).integers(0, 256, (64, 1, 28, 28), dtype=np.uint8)
    out = augment.shift_and_flip(images, policy, augment.batch_rng(0, 0, 0))
    same = [np.array_equal(o, i) for o, i in zip(out, images)]
    mirrored = [np.array_equal(o, i[:, :, ::-1]) for o, i in zip(out, images)]
    assert all(s or m for s, m in zip(same, mirrored))
    assert 10 < sum(mirrored) < 54  # about half flipped
    assert augment.describe("fashion-mnist", (1, 28, 28), 0) == "horizontal flips"


@pytest.mark.parametrize("side, pad", [(32, 2), (28, 2), (64, 4), (16, 1), (128, 9), (10, 1), (4, 1)])
@pytest.mark.parametrize("channels", [1, 3])
def test_a_folder_shifts_by_a_fourteenth_of_its_side_and_flips_only_with_flip(side, pad, channels):
    """MNIST's 2 px of 28, scaled to the side and rounded down, at least 1 px, grey or colour."""
    shape = (channels, side, side)
    assert augment.policy_for("folder", shape) == augment.Augment(pad=pad, flip=False)
    assert augment.policy_for("folder", shape, flip=True) == augment.Augment(pad=pad, flip=True)
    assert augment.policy_for("folder", shape, shift=5) == augment.Augment(pad=5, flip=False)


def test_a_rectangle_shifts_by_its_shorter_side():
    assert augment.policy_for("folder", (3, 96, 64)).pad == 4


def test_mirror_asymmetry_tells_clothes_from_digits_on_the_shipped_datasets():
    """Fashion-MNIST's classes look the same mirrored (measured 0.18), MNIST's digits do not (0.64): the rule flips
    the one and not the other, as their built-in policies do."""
    for name in ("fashion-mnist", "mnist"):
        train = data.load_dataset(name).train
        flips = augment.mirror_asymmetry(train.images, train.labels) < augment.MIRROR_SYMMETRIC
        assert flips == augment.POLICIES[name].flip, name


def test_mirror_asymmetry_of_mirror_images_and_of_handed_ones():
    x = np.linspace(0, 255, 16)
    handed = np.broadcast_to(x, (6, 1, 16, 16)).astype(np.uint8)  # dark left, bright right: a handedness
    symmetric = np.concatenate([handed[..., :8], handed[..., :8][..., ::-1]], axis=-1)
    labels = np.array([0, 0, 0, 1, 1, 1])
    assert augment.mirror_asymmetry(symmetric, labels) == 0
    assert augment.mirror_asymmetry(handed, labels) > 1
    assert augment.mirror_asymmetry(np.zeros((4, 3, 8, 8), np.uint8), np.array([0, 1, 0, 1])) == 0  # flat


def test_the_folder_rule_at_28_px_is_mnists_policy():
    assert augment.policy_for("folder", (1, 28, 28)) == augment.POLICIES["mnist"]
    assert augment.policy_for("cifar10", (3, 32, 32)) == augment.POLICIES["cifar10"]  # a built-in's is its own


def test_the_start_up_line_names_the_folder_rule_and_points_to_flip_where_the_classes_look_mirror_symmetric():
    describe = augment.describe
    assert describe("folder", (3, 32, 32), asymmetry=0.07) == (
        "random shifts of up to 2 px and no flips (1/14 of 32 px; --shift N to change; the classes look the same "
        "mirrored (mirror asymmetry 0.07): --flip to flip them)"
    )
    assert describe("folder", (1, 28, 28), asymmetry=0.64) == (
        "random shifts of up to 2 px and no flips (1/14 of 28 px; --shift N to change; the classes look handed "
        "(mirror asymmetry 0.64): flips would change them)"
    )
    assert "(1/14 of 48 px, the shorter side;" in describe("folder", (3, 48, 64))
    assert describe("folder", (1, 28, 28)).endswith("; --flip if a mirror keeps the class)")  # not measured
    assert (
        describe("folder", (3, 32, 32), 6, True, 0.07)
        == "random shifts of up to 6 px and horizontal flips (--shift 6; --flip)"
    )
    assert (
        describe("folder", (1, 28, 28), 0) == "no shifts and no flips (--shift 0; --flip if a mirror keeps the class)"
    )
    assert describe("cifar10", (3, 32, 32)) == "random shifts of up to 4 px and horizontal flips"


# ---- shards, the sampler, prefetch ----


@pytest.mark.parametrize("n", [0, 1, 7, 10000, 10001])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_eval_shards_cover_every_image_once(n, world):
    seen = np.concatenate([np.arange(n)[data.eval_shard(n, r, world)] for r in range(world)])
    assert sorted(seen.tolist()) == list(range(n))


def test_sampler_gives_each_worker_its_part_of_every_global_batch():
    """Rank r's k-th batch is the r-th slice of the one-process k-th global batch."""
    n, global_batch = 1000, 96
    one = data.make_sampler(n, global_batch, 0, 1)
    two = [data.make_sampler(n, global_batch // 2, r, 2) for r in range(2)]
    for s in (one, *two):
        s.set_epoch(data.sampler_epoch(7, 3))
    full, halves = list(one), [list(s) for s in two]
    assert len(full) == len(halves[0]) == len(halves[1]) == n // global_batch
    for k, batch in enumerate(full):
        assert halves[0][k] + halves[1][k] == batch


def test_seed_changes_the_data_order():
    orders = []
    for seed in (1, 2):
        s = data.make_sampler(100, 10, 0, 1)
        s.set_epoch(data.sampler_epoch(seed, 0))
        orders.append(next(iter(s)))
    assert orders[0] != orders[1]


def test_prefetch_passes_errors_through():
    def broken():
        yield 1
        raise data.DataError("bad batch")

    it = data.prefetch(broken())
    assert next(it) == 1
    with pytest.raises(data.DataError, match="bad batch"):
        next(it)


def test_the_prefetch_stage_runs_in_the_background_thread():
    threads = []

    def stage(item):
        threads.append(threading.current_thread())
        return item * 10

    assert list(data.prefetch(iter([1, 2, 3]), stage=stage)) == [10, 20, 30]
    assert len(threads) == 3 and threading.main_thread() not in threads


# ---- through the trainer ----

TINY = ["--log-every", "0", "--lr", "0.01", "--epochs", "2"]


@pytest.mark.slow
def test_two_workers_train_on_a_cifar10_archive(tmp_path):
    write_cifar_archive(tmp_path / "c" / ARCHIVE, cifar_members(n_per_batch=64, n_test=50))
    args = [*TINY, "--dataset", "cifar10", "--data-dir", str(tmp_path / "c"), "--output-dir", str(tmp_path / "o")]
    proc = run_launch(args, cwd=tmp_path, log_dir=tmp_path / "log")
    assert proc.returncode == 0, explain(proc, tmp_path / "log")
    rows = read_metrics(tmp_path / "o")
    assert [r["val_count"] for r in rows] == [50, 50] and rows[-1]["step"] == 4  # 320 images / 128 per step
    assert all(0 <= r["input_wait_share"] < 1 for r in rows)
    result = read_results(tmp_path / "o")
    assert result["test_count"] == 50 and result["peak_rss_mb"] > 0
    for rank in (0, 1):
        text = worker_log(tmp_path / "log", rank)
        assert "dataset cifar10 (3x32x32, 10 classes): train 320 of 320" in text
        assert "augmentation random shifts of up to 4 px and horizontal flips" in text
        assert "input wait" in text


def write_image_folder(root, side: int, channels: int, handed: bool, per_class: int = 12) -> None:
    """train/<class>/*.png: three classes of side x side pictures with a little noise, RGB or grey. Each class has
    its own pattern across the width: the same both ways (a bright or dark middle) or, handed, a ramp from one side
    to the other (a mirror turns it round)."""
    rng = np.random.default_rng(0)
    x = np.abs(np.linspace(-1, 1, side)) if not handed else np.linspace(0, 1, side)
    for k, name in enumerate(("ant", "bee", "cat")):
        (root / "train" / name).mkdir(parents=True)
        pattern = 40 + 170 * (x if k % 2 else 1 - x) ** (k + 1)
        for i in range(per_class):
            noise = rng.normal(0, 8, (side, side, channels))
            pixels = np.clip(pattern[None, :, None] + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels.squeeze(axis=2) if channels == 1 else pixels).save(
                root / "train" / name / f"{i}.png"
            )


FOLDER_RUN = ["--dataset", "folder", "--batch-size", "8", "--epochs", "1", "--log-every", "0"]


@pytest.mark.slow
@pytest.mark.parametrize("handed", [False, True], ids=["mirror-symmetric", "handed"])
def test_the_start_up_line_says_whether_a_folders_classes_look_the_same_mirrored(tmp_path, handed):
    """The cache measures the classes' mirror symmetry, and the start-up line of a run on 48 px colour PNG files
    points to --flip, or says flips would change the classes."""
    write_image_folder(tmp_path / "photos", 48, channels=3, handed=handed)
    args = [*FOLDER_RUN, "--data-dir", str(tmp_path / "photos"), "--augment", "--output-dir", str(tmp_path / "o")]
    proc = run_single(args, cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    said = "look handed (mirror asymmetry " if handed else "look the same mirrored (mirror asymmetry 0."
    line = next(x for x in proc.stdout.splitlines() if "augmentation " in x)
    assert "augmentation random shifts of up to 3 px and no flips (1/14 of 48 px; --shift N to change; " in line
    assert f"the classes {said}" in line, line


@pytest.mark.slow
def test_mnist_json_validates_on_valid_and_tests_on_eval(tmp_path):
    write_mnist_json(tmp_path / "j" / "mnist.json.gz", mnist_json_tree((256, 40, 30)))
    args = [*TINY, "--dataset", "mnist-json", "--data-dir", str(tmp_path / "j"), "--output-dir", str(tmp_path / "o")]
    proc = run_single(args, cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "o")
    assert [r["val_count"] for r in rows] == [40, 40]
    assert read_results(tmp_path / "o")["test_count"] == 30
    assert "validation 40 of 40, test 30 of 30" in proc.stdout


@pytest.mark.slow
def test_a_damaged_archive_stops_the_run_before_anything_is_written(tmp_path):
    write_cifar_archive(tmp_path / "c" / ARCHIVE, damaged_cifar("label out of range"))
    args = [*TINY, "--dataset", "cifar10", "--data-dir", str(tmp_path / "c"), "--output-dir", str(tmp_path / "o")]
    proc = run_launch(args, cwd=tmp_path, log_dir=tmp_path / "log")
    assert proc.returncode != 0
    for rank in (0, 1):
        errors = [line for line in worker_log(tmp_path / "log", rank).splitlines() if "error:" in line]
        assert len(errors) == 1 and "data_batch_2: label 10 is outside 0..9" in errors[0], errors
    assert not (tmp_path / "o").exists()
