"""One distributed evaluation: each worker scores its own shard, and the sums are all-reduced, so every image counts
once; with the confusion matrix, the top-k hits and the first examples of each confused pair."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.nn.functional as F

from paddle_mnist.config import Config
from paddle_mnist.datasets import data
from paddle_mnist.runtime.distributed import DistEnv, all_reduce_sum, gather_objects, unwrap
from paddle_mnist.training import scores


@dataclass(frozen=True)
class EvalStats:
    loss: float
    acc: float
    count: int
    # all workers' int64 (classes, classes) counts (row: true class), whose trace over count is acc
    confusion: np.ndarray | None = field(default=None, compare=False, repr=False)
    top_k: int | None = field(default=None, compare=False)  # images with the true class in the top scores.TOP_K
    # this worker's own: the first split indices of each confused (true, predicted) pair in its shard
    examples: dict = field(default_factory=dict, compare=False, repr=False)


@paddle.no_grad()
def evaluate(
    model: paddle.nn.Layer,
    split: data.Split,
    ds: data.Dataset,
    cfg: Config,
    env: DistEnv,
    alive: Callable[..., None] | None = None,
    tta: bool = False,
) -> EvalStats:
    """Each worker scores its own disjoint shard; the sums are all-reduced, so every image counts once. tta: with
    cfg's test-time augmentation (--tta, --tta-shift), else each image once.

    alive: called after every layer's forward (the watchdog's, so that a long evaluation is not taken for a hang,
    and another rank waiting for this one in the all-reduce sees it at work however large the batch).
    """
    net = unwrap(model)
    net.eval()
    shard = data.eval_shard(len(split), env.rank, env.world_size)
    hooks = [layer.register_forward_post_hook(alive) for layer in net.sublayers()] if alive else []
    try:
        sums = _score_shard(net, split, ds, cfg, shard, tta)
    finally:
        for hook in hooks:
            hook.remove()
    # one all-reduce, exact: float64 holds every count below 2**53
    totals = all_reduce_sum(np.concatenate([sums.sums, [sums.top_k], sums.confusion.ravel()]), env)
    correct, loss_sum, count = totals[:3]
    k = len(ds.classes)
    return EvalStats(
        loss=loss_sum / count,
        acc=correct / count,
        count=int(count),
        confusion=totals[4:].astype(np.int64).reshape(k, k),
        top_k=int(totals[3]) if k > scores.TOP_K else None,
        examples=sums.examples,
    )


def confused_examples(stats: EvalStats, pairs: list[tuple[int, int, int]], env: DistEnv) -> dict:
    """{(true, predicted): the split indices of the pair's first scores.EXAMPLES images} for pairs (every rank's
    the same, from the all-reduced matrix): each rank sends only its own first few of these pairs. Shards are
    contiguous and in rank order, so the first few over ranks in turn are the split's first few. Every rank must
    call it."""
    mine = [stats.examples.get((t, p), []) for t, p, _ in pairs]
    by_rank = gather_objects(mine, env)
    return {(t, p): [i for r in by_rank for i in r[n]][: scores.EXAMPLES] for n, (t, p, _) in enumerate(pairs)}


def tta_logits(net: paddle.nn.Layer, x: paddle.Tensor, shift: bool) -> paddle.Tensor:
    """The mean output over the image and its mirror image; with shift, the pair counts half and the other half
    goes to the pair moved 1 px up-left and the pair moved 1 px down-right (edges reflected)."""
    pair = (net(x) + net(paddle.flip(x, axis=[3]))) / 2
    if not shift:
        return pair
    h, w = x.shape[2], x.shape[3]
    padded = F.pad(x, [1, 1, 1, 1], mode="reflect")
    moved = 0
    for at in (0, 2):
        view = padded[:, :, at : at + h, at : at + w]
        moved = moved + (net(view) + net(paddle.flip(view, axis=[3]))) / 4
    return (pair + moved) / 2


@dataclass(frozen=True)
class ShardScore:
    sums: np.ndarray  # (correct, summed loss, count)
    confusion: np.ndarray  # int64 (classes, classes)
    top_k: int  # images whose true class is among the scores.TOP_K highest outputs
    examples: dict  # (true, predicted) -> the pair's first split indices in the shard (scores.first_wrong)


def _score_shard(
    net: paddle.nn.Layer, split: data.Split, ds: data.Dataset, cfg: Config, shard: range, tta: bool = False
) -> ShardScore:
    """The shard's figures, batch by batch: each image's prediction is counted once, into the sums and the matrix."""
    k = len(ds.classes)
    sums, matrix, top, examples = np.zeros(3), np.zeros((k, k), np.int64), 0, {}
    for lo in range(shard.start, shard.stop, cfg.eval_batch_size):
        idx = np.arange(lo, min(lo + cfg.eval_batch_size, shard.stop))
        images, labels = next(data.batches(split, ds, [idx]))
        x, y = paddle.to_tensor(images), paddle.to_tensor(labels)
        logits = tta_logits(net, x, cfg.tta_shift) if tta and cfg.tta else net(x)
        predicted = logits.argmax(axis=1).numpy()
        sums += (
            float((predicted == labels).sum()),
            float(F.cross_entropy(logits, y, reduction="sum")),
            len(idx),
        )
        matrix += scores.confusion(labels, predicted, k)
        top += scores.top_k_hits(logits.numpy(), labels) if k > scores.TOP_K else 0
        scores.first_wrong(labels, predicted, idx, examples)
    return ShardScore(sums, matrix, top, examples)
