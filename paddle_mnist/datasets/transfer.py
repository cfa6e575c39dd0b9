"""Training batches from the host to the device: page-locked memory and non-blocking copies on a GPU."""

from __future__ import annotations

import numpy as np
import paddle

from paddle_mnist.runtime.launch import gpu_index


def pins(device: str) -> bool:
    """Whether batches go through page-locked (pinned) host memory: on a GPU only. A copy from pinned memory can
    run without blocking the host, and the prefetch thread does the pinning; on CPU there is nothing to copy."""
    return gpu_index(device) is not None


def split(images, labels, k: int) -> list[tuple]:
    """k micro-batches of (images, labels), as numpy arrays or as tensors alike."""
    if isinstance(images, np.ndarray):
        return list(zip(np.split(images, k), np.split(labels, k)))
    return list(zip(paddle.split(images, k), paddle.split(labels, k)))


class Feed:
    """One worker's way from a batch of numpy arrays to tensors on its device.

    On CPU, paddle.to_tensor of each micro-batch, as always. On a GPU, `host` (run in the prefetch thread) copies
    the batch into pinned memory, and `micro_batches` copies it to the GPU with blocking=False (Tensor.cuda) and
    splits it there. The copy is queued on the device's stream ahead of the forward pass, so the pass reads it
    complete; the pinned batch is kept until an event recorded after the copy has passed, so its memory is not
    handed to a later batch while the copy still reads it.
    """

    def __init__(self, device: str):
        self.device = device
        self.pinned = pins(device)
        self._in_flight: tuple | None = None  # (pinned batch, event after its copy)

    def host(self, batch: tuple[np.ndarray, np.ndarray]) -> tuple:
        """Runs in the prefetch thread: on a GPU, the batch in pinned memory; on CPU, the batch as it is."""
        if not self.pinned:
            return batch
        # a new thread's CUDA calls go to GPU 0 unless it is told its place; Paddle's own DataLoader thread does
        # the same (_thread_loop in paddle/io/dataloader/dataloader_iter.py)
        paddle.base.framework._set_expected_place(paddle.CUDAPlace(gpu_index(self.device)))
        return tuple(paddle.to_tensor(a, place=paddle.CUDAPinnedPlace()) for a in batch)

    def micro_batches(self, images, labels, k: int) -> list[tuple[paddle.Tensor, paddle.Tensor]]:
        if not self.pinned:
            return [(paddle.to_tensor(x), paddle.to_tensor(y)) for x, y in split(images, labels, k)]
        on_device = (images.cuda(blocking=False), labels.cuda(blocking=False))
        event = paddle.device.Event()  # on the current device (3.3 has no device argument, 2.6 defaults to it)
        event.record()
        if self._in_flight:
            self._in_flight[1].synchronize()  # the previous batch's copy is done: its pinned memory may go
        self._in_flight = ((images, labels), event)
        return split(*on_device, k)
