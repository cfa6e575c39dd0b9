"""Training a step and an epoch, each returning its figures."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import paddle
import paddle.nn.functional as F

from paddle_mnist.config import Config
from paddle_mnist.datasets import data
from paddle_mnist.datasets.transfer import Feed
from paddle_mnist.files import events
from paddle_mnist.files.log import ProgressBar, memory_mb
from paddle_mnist.network import batchnorm, dropout, exact
from paddle_mnist.runtime.distributed import (
    DistEnv,
    all_reduce_max,
    all_reduce_sum,
    average_gradients,
    device_sync,
    gradient_sync,
    sum_each_over_workers,
    sum_over_workers,
)
from paddle_mnist.training import timing


@dataclass(frozen=True)
class EpochStats:
    loss: float
    acc: float
    images: int  # global, all workers
    steps: int
    seconds: float  # slowest worker's wall time for the epoch's steps
    input_wait: float  # this worker's seconds spent waiting for a batch
    own_seconds: float  # this worker's wall time for the epoch's steps
    phase_shares: dict  # this worker's share of step time per phase (timing.PHASES; None where not sampled)
    samples: int  # steps whose phases were timed
    clipped: int = 0  # steps whose gradients --clip-grad-norm scaled down (the same on every worker)
    grad_norm: float = 0.0  # mean finite global gradient norm before clipping, when --clip-grad-norm is on
    skipped: int = 0  # steps whose gradient norm was inf or NaN (fp16 overflow: the loss scaler skips them)

    @property
    def clipped_share(self) -> float:
        """Of the steps with a finite gradient norm: a skipped step is neither clipped nor counted."""
        counted = self.steps - self.skipped
        return self.clipped / counted if counted else 0.0

    @property
    def images_per_sec(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


class Diverged(RuntimeError):
    """The training loss stopped being a finite number."""


class Epoch:
    """One epoch of training for one worker, a step at a time: `for step in Epoch(...)` trains one optimizer step
    per iteration and hands control back after each (for checkpoints, stop signals, the moving average); once the
    batches are used up, `stats` holds the epoch's figures, summed over workers. The state's position advances as
    it goes, so a checkpoint taken between two steps records exactly where training stands.
    """

    def __init__(self, state, batches: data.Batches, cfg: Config, env: DistEnv, log: logging.Logger, feed: Feed):
        self.state, self.batches, self.cfg, self.env, self.log, self.feed = state, batches, cfg, env, log, feed
        self.tally = StepTally(cfg.clip_grad_norm)
        self.stats: EpochStats | None = None

    @property
    def loss_sum(self) -> paddle.Tensor:
        """This worker's training loss summed so far, on the device: read only when needed."""
        return self.tally.loss_sum

    def __iter__(self) -> Iterator[int]:
        state, cfg, env = self.state, self.cfg, self.env
        state.model.train()
        total = self.batches.count
        tally = self.tally
        timer = timing.StepTimer(cfg.timing_every, device_sync(env))
        progress = Progress(self.log, cfg, env, total, state)
        batches = iter(self.batches)
        try:
            for steps in range(1, total + 1):
                t0 = time.perf_counter()
                images, labels = next(batches)
                t1 = time.perf_counter()
                timer.add("input_wait", t1 - t0)
                figures = train_step(state, images, labels, cfg, self.feed, env, timer.sampling(steps))
                state.advance()
                t2 = time.perf_counter()
                timer.add_compute(t2 - t1, timer.wants(steps))
                tally.add(figures, len(labels))
                progress.after_step(steps, figures, tally, timer)
                yield state.step  # the caller's checkpoints and meetings count as logging/checkpoints time
                timer.add("logging", time.perf_counter() - t2)
        finally:
            self.batches.close()
        self.stats = tally.stats(steps, time.perf_counter() - progress.start, timer, env, state)


class Progress:
    """An epoch's progress for the user: a log line every --log-every steps (after checking that every worker's loss
    is finite) and, on rank 0 at a terminal, a bar."""

    def __init__(self, log: logging.Logger, cfg: Config, env: DistEnv, total: int, state):
        self.log, self.cfg, self.env, self.total, self.state = log, cfg, env, total, state
        self.bar = ProgressBar(env.is_main, total, f"epoch {state.epoch + 1}")
        self.start = time.perf_counter()

    def after_step(self, steps: int, figures: StepFigures, tally: StepTally, timer: timing.StepTimer) -> None:
        state, env, every = self.state, self.env, self.cfg.log_every
        if every and (steps % every == 0 or steps == self.total):
            check_finite(float(tally.loss_sum), state, env)
            elapsed = time.perf_counter() - self.start
            now = {
                "loss": float(figures.loss),
                "acc": float(figures.correct) / tally.last_images,
                "lr": state.opt.get_lr(),
                "images_per_sec": tally.seen * env.world_size / elapsed,
                "input_wait_share": timer.seconds["input_wait"] / elapsed,
            }
            rss = memory_mb()[0]
            self.log.info(  # the memory figure is the last word of a worker the out-of-memory killer ends
                f"epoch {state.epoch + 1} step {steps}/{self.total} loss {now['loss']:.4f} lr {now['lr']:.5f} "
                f"{now['images_per_sec']:.0f} img/s (global), memory {rss:.0f} MiB",
                extra={"step": state.step, "scalars": now},  # figures for --visualdl's handler
            )
            events.emit("progress", epoch=state.epoch + 1, step=steps, steps=self.total, memory_mb=round(rss))
        if self.bar.enabled:
            self.bar.update(steps, f"loss {float(figures.loss):.4f}")


class StepTally:
    """An epoch's sums of its steps' figures, on the device (read only when needed): loss, correct predictions,
    images, and the gradient norms."""

    def __init__(self, clip: float):
        self.loss_sum = paddle.zeros([], dtype="float32")  # this worker's
        self.correct = paddle.zeros([], dtype="int64")
        self.norms = NormTally(clip)
        self.seen = self.last_images = 0

    def add(self, figures: StepFigures, images: int) -> None:
        self.loss_sum += figures.loss_sum
        self.correct += figures.correct
        self.seen, self.last_images = self.seen + images, images
        if figures.norm is not None:
            self.norms.add(figures.norm)

    def stats(self, steps: int, own: float, timer: timing.StepTimer, env: DistEnv, state) -> EpochStats:
        """The epoch's figures, summed over the workers (every worker must call it)."""
        seconds = all_reduce_max(own, env)
        totals = all_reduce_sum([float(self.loss_sum), float(self.correct), self.seen], env)
        check_finite(totals[0], state, env)
        images = int(totals[2])
        return EpochStats(
            loss=totals[0] / max(images, 1),
            acc=totals[1] / max(images, 1),
            images=images,
            steps=steps,
            seconds=seconds,
            input_wait=timer.seconds["input_wait"],
            own_seconds=own,
            phase_shares=timing.shares(timer.seconds, own, timer.compute, timer.sampled_compute),
            samples=timer.samples,
            clipped=int(self.norms.clipped),
            grad_norm=self.norms.mean(),
            skipped=int(self.norms.skipped),
        )


class NormTally:
    """An epoch's global gradient norms before clipping, summed on the device (no wait for a value at each step).

    With fp16, an overflow step's gradients are inf or NaN after unscaling, and GradScaler skips that step: its
    norm is left out of the mean and out of the clipped count, and counted as skipped instead.
    """

    def __init__(self, clip: float):
        self.clip = clip
        self.total = paddle.zeros([], dtype="float32")
        self.clipped = paddle.zeros([], dtype="int64")
        self.skipped = paddle.zeros([], dtype="int64")
        self.counted = paddle.zeros([], dtype="int64")

    def add(self, norm: paddle.Tensor) -> None:
        finite = paddle.isfinite(norm)
        self.total += paddle.where(finite, norm, paddle.zeros_like(norm))
        self.clipped += paddle.logical_and(finite, norm > self.clip).astype("int64")
        self.skipped += paddle.logical_not(finite).astype("int64")
        self.counted += finite.astype("int64")

    def mean(self) -> float:
        return float(self.total) / max(int(self.counted), 1)


def amp_context(cfg: Config):
    """auto_cast for --amp fp16/bf16; a context that changes nothing when it is off."""
    if cfg.amp == "off":
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(dtype={"fp16": "float16", "bf16": "bfloat16"}[cfg.amp], level="O1")


def global_grad_norm(params: list) -> paddle.Tensor:
    """The norm of all gradients together, as paddle.nn.ClipGradByGlobalNorm computes it (in float32)."""
    squares = [paddle.sum(paddle.square(p.grad.astype("float32"))) for p in params if p.grad is not None]
    return paddle.sqrt(paddle.add_n(squares))


ONE_PROCESS = DistEnv(0, 1, 0, 1, "none", "cpu")


class StepFigures(NamedTuple):
    loss: paddle.Tensor  # the last micro-batch's mean loss
    loss_sum: paddle.Tensor  # summed over this worker's images
    correct: paddle.Tensor  # this worker's images predicted right
    norm: paddle.Tensor | None  # the global gradient norm before clipping (--clip-grad-norm), else None


def train_step(state, images, labels, cfg: Config, feed: Feed, env: DistEnv, timer=timing.UNTIMED) -> StepFigures:
    """One optimizer step over --accum-steps micro-batches of this worker's share of the global batch (what
    feed.host made of it; micro-batch i is its slice of the global micro-batch i, data.worker_places).

    Every image's loss weighs 1/(the images its gradient is averaged over): the worker's batch, whose gradients
    are then averaged over the workers once, after the last backward pass (through shared memory where env's
    carrier has it, else by DataParallel inside that pass); or, where state.exact, the global batch, every pass
    keeping its gradients local and the step's float64 sums (network/exact.py) summed over the workers once and
    rounded to float32 once. Dropout draws its masks and batch norm over the global batch meets the other workers
    by the micro-batch's place in the global batch (micro_batch_places). timer: timing.StepTimer on a sampled step.
    """
    model, k = state.model, cfg.accum_steps
    sums = exact.Sums() if state.exact else None
    weight = 1.0 / (len(labels) * env.world_size if sums is not None else len(labels))
    add = sum_over_workers(model, env)
    loss_sums, corrects = [], []
    for i, (x, y) in enumerate(feed.micro_batches(images, labels, k)):
        sync = i == k - 1 and sums is None  # DataParallel's all-reduce inside the last backward pass
        places = micro_batch_places(state, cfg, env, i, len(y), len(labels), add)
        with places, exact.summing(sums), gradient_sync(model, env, sync):
            with timer.phase("forward"):
                with amp_context(cfg):
                    logits = model(x)
                losses = image_losses(state, in_float32(logits), y, cfg)
                loss_sum = losses.sum()
            with timer.phase("backward"):
                (state.scaler.scale(loss_sum * weight) if state.scaler else loss_sum * weight).backward()
        loss_sums.append(loss_sum.detach())
        truth = y if y.ndim == 1 else y[:, 0].astype("int64")  # a mixed image's own label
        corrects.append((logits.argmax(axis=1) == truth).astype("int64").sum())
    with timer.phase("backward"):
        if sums is not None:
            sums.gradients(model.parameters(), sum_each_over_workers(model, env))
        else:
            average_gradients(model, env)
    with timer.phase("optimizer"):
        norm = update(state, cfg)
    return StepFigures(losses.mean(), paddle.add_n(loss_sums), paddle.add_n(corrects), norm)


def image_losses(state, logits: paddle.Tensor, y: paddle.Tensor, cfg: Config) -> paddle.Tensor:
    """Each image's loss: the cross-entropy of its label (smoothed by --label-smoothing), times its class's weight
    under --class-weights. y is the labels, or for images mixed with a partner (--mixup, --cutmix) rows of (label,
    partner's label, lam): lam times its own label's loss plus 1 - lam times the partner's."""

    def of(labels: paddle.Tensor) -> paddle.Tensor:
        losses = F.cross_entropy(logits, labels, reduction="none", label_smoothing=cfg.label_smoothing).flatten()
        if state.class_weights is not None:
            losses = losses * paddle.gather(state.class_weights, labels.flatten())
        return losses

    if y.ndim == 1:
        return of(y)
    lam = y[:, 2]
    return lam * of(y[:, 0].astype("int64")) + (1 - lam) * of(y[:, 1].astype("int64"))


@contextlib.contextmanager
def micro_batch_places(state, cfg: Config, env: DistEnv, i: int, size: int, worker_batch: int, add) -> Iterator[None]:
    """Micro-batch i (size images) of this worker's worker_batch images, in its place in the global batch:
    dropout's masks drawn by it (dropout.Place) and batch norm over the global batch meeting the other workers'
    images of global micro-batch i (batchnorm.Meeting)."""
    micro = size * env.world_size  # the global micro-batch: every worker's micro-batch i
    place = dropout.Place(cfg.seed, state.step, i * micro + env.rank * size, worker_batch * env.world_size)
    meet = batchnorm.Meeting(add, env.rank * size, micro, env.rank == 0, env.world_size)
    with dropout.placed(dropout.layers(state.model), place), batchnorm.meeting(meet):
        yield


def in_float32(logits: paddle.Tensor) -> paddle.Tensor:
    """The loss in float32 whatever precision the network ran in."""
    return logits if logits.dtype == paddle.float32 else logits.astype("float32")


def update(state, cfg: Config) -> paddle.Tensor | None:
    """The optimizer's step on the averaged gradients (the same on every worker, so all clip alike); the global
    gradient norm before ClipGradByGlobalNorm clips them, with --clip-grad-norm (else None)."""
    opt, scaler, norm = state.opt, state.scaler, None
    if cfg.clip_grad_norm:
        if scaler:
            scaler.unscale_(opt)  # the norm of the true gradients; scaler.step then does not unscale again
        norm = global_grad_norm(state.model.parameters())
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.clear_grad()
    return norm


def weights_finite(model: paddle.nn.Layer) -> bool:
    return all(bool(paddle.isfinite(p).all()) for p in model.parameters())


def check_finite(loss_sum: float, state, env: DistEnv) -> None:
    """Stop every worker together once any worker's loss is NaN or infinite (an all-reduce, so none is left
    waiting). Checkpoints are never written from a diverged state, so the last one is good."""
    bad = all_reduce_sum([0.0 if math.isfinite(loss_sum) else 1.0], env)[0]
    if bad:
        raise Diverged(
            f"the training loss became NaN or infinite by step {state.step} (learning rate {state.opt.get_lr():.4g}); "
            "the likely cause is a learning rate too high for this batch size: lower --lr, and restart or --resume "
            "from the last checkpoint (it was saved before the loss diverged)"
        )


def check_weights(state) -> None:
    """Stop once the weights are NaN or infinite: they are identical on every rank, so all stop here together."""
    if not weights_finite(state.model):
        raise Diverged(
            f"the weights became NaN or infinite in epoch {state.epoch + 1} (by step {state.step}); lower --lr, and "
            "restart or --resume from the last checkpoint (it was saved before this)"
        )
