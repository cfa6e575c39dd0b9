"""The host-to-device feed (transfer.py): pinned memory on GPUs only, the CPU path as before, the same micro-batches."""

from __future__ import annotations

import numpy as np
import paddle

from paddle_mnist.datasets import transfer


def test_batches_go_through_pinned_memory_on_gpus_only():
    assert [transfer.pins(d) for d in ("cpu", "gpu:0", "gpu:3")] == [False, True, True]
    assert not transfer.Feed("cpu").pinned and transfer.Feed("gpu:1").pinned


def test_the_cpu_feed_is_paddle_to_tensor_of_each_micro_batch_as_before():
    rs = np.random.RandomState(0)
    images, labels = rs.rand(8, 1, 4, 4).astype(np.float32), rs.randint(0, 10, 8).astype(np.int64)
    feed = transfer.Feed("cpu")
    assert feed.host((images, labels))[0] is images  # nothing happens in the prefetch thread on CPU
    for k in (1, 2, 4):
        got = feed.micro_batches(images, labels, k)
        want = [(paddle.to_tensor(x), paddle.to_tensor(y)) for x, y in zip(np.split(images, k), np.split(labels, k))]
        assert len(got) == k
        for (x, y), (wx, wy) in zip(got, want):
            assert x.place.is_cpu_place() and x.dtype == wx.dtype and y.dtype == wy.dtype
            assert np.array_equal(x.numpy(), wx.numpy()) and np.array_equal(y.numpy(), wy.numpy())


def test_the_gpu_feeds_split_of_a_copied_batch_matches_the_split_of_its_arrays():
    """On a GPU the whole batch is copied, then split on the device: the same micro-batches (run here on CPU
    tensors, which take the same paddle.split)."""
    images, labels = np.arange(48, dtype=np.float32).reshape(6, 2, 4), np.arange(6, dtype=np.int64)
    on_device = transfer.split(paddle.to_tensor(images), paddle.to_tensor(labels), 3)
    for (x, y), (wx, wy) in zip(on_device, transfer.split(images, labels, 3)):
        assert np.array_equal(x.numpy(), wx) and np.array_equal(y.numpy(), wy)
