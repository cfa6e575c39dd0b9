"""One training epoch and one distributed evaluation, each returning its figures."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from . import augment, data, timing
from .config import Config, effective_lr
from .distributed import (
    DistEnv,
    all_reduce_gradients,
    all_reduce_max,
    all_reduce_sum,
    device_sync,
    gradient_sync,
    unwrap,
)
from .log import ProgressBar


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

    @property
    def images_per_sec(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class EpochPlan:
    epoch: int  # 0-based
    skip: int  # batches of this epoch trained before a mid-epoch checkpoint; passed over unread
    first_step: int  # optimizer steps done before this call
    last_step: int  # stop when the step count reaches this


class Diverged(RuntimeError):
    """The training loss stopped being a finite number."""


@dataclass(frozen=True)
class EvalStats:
    loss: float
    acc: float
    count: int


class IndexSpace:
    """What DistributedBatchSampler needs of a dataset: its length. Batches are built from indices."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def make_sampler(n: int, cfg: Config, env: DistEnv) -> paddle.io.DistributedBatchSampler:
    return paddle.io.DistributedBatchSampler(
        IndexSpace(n),
        batch_size=cfg.batch_size // env.world_size,
        num_replicas=env.world_size,
        rank=env.rank,
        shuffle=True,
        drop_last=True,
    )


def make_schedule(cfg: Config, total_steps: int, warmup_steps: int) -> paddle.optimizer.lr.LRScheduler:
    """Linear warmup from 0 (if any), then poly (power 1: linear to 0 at the last planned step) or constant."""
    peak = effective_lr(cfg)
    decay_steps = max(total_steps - warmup_steps, 1)
    end = 0.0 if cfg.lr_schedule == "poly" else peak  # constant: a decay from peak to peak
    sched = paddle.optimizer.lr.PolynomialDecay(peak, decay_steps=decay_steps, end_lr=end, power=1.0)
    if warmup_steps:
        sched = paddle.optimizer.lr.LinearWarmup(sched, warmup_steps=warmup_steps, start_lr=0.0, end_lr=peak)
    return sched


def make_optimizer(cfg: Config, model: paddle.nn.Layer, total_steps: int, warmup_steps: int = 0):
    sched = make_schedule(cfg, total_steps, warmup_steps)
    decay = paddle.regularizer.L2Decay(cfg.weight_decay) if cfg.weight_decay else None
    opt = paddle.optimizer.Momentum(
        learning_rate=sched, momentum=cfg.momentum, parameters=model.parameters(), weight_decay=decay
    )
    return opt, sched


def train_one_epoch(
    model: paddle.nn.Layer,
    opt: paddle.optimizer.Optimizer,
    sched: paddle.optimizer.lr.LRScheduler,
    split: data.Split,
    sampler: paddle.io.DistributedBatchSampler,
    ds: data.Dataset,
    cfg: Config,
    env: DistEnv,
    log: logging.Logger,
    plan: EpochPlan,
    on_step: Callable[[int, int, paddle.Tensor], None] | None = None,
    scaler: paddle.amp.GradScaler | None = None,
) -> EpochStats:
    """Train until the sampler is exhausted or the last step is done; figures are summed over workers.

    on_step(batch_in_epoch, step, loss_sum) runs after every optimizer step (used for mid-epoch checkpoints).
    """
    model.train()
    epoch, skip = plan.epoch, plan.skip
    total = min(len(sampler) - skip, plan.last_step - plan.first_step)
    bar = ProgressBar(env, total, f"epoch {epoch + 1}")
    loss_sum = paddle.zeros([], dtype="float32")
    correct = paddle.zeros([], dtype="int64")
    seen = steps = 0
    timer = timing.StepTimer(cfg.timing_every, device_sync(env))
    start = time.perf_counter()
    policy = augment.policy_for(ds.name, cfg.shift)
    plan_aug = data.AugmentPlan(policy, cfg.seed, env.rank, epoch) if cfg.augment else None
    indices = itertools.islice(sampler, skip, None)
    batches = data.prefetch(data.batches(split, ds, indices, plan_aug, first=skip))
    for steps in range(1, total + 1):
        t0 = time.perf_counter()
        images, labels = next(batches)
        t1 = time.perf_counter()
        timer.add("input_wait", t1 - t0)
        sampled = timer if timer.wants(steps) else None
        loss, batch_loss_sum, batch_correct = train_step(model, opt, scaler, images, labels, cfg, sampled)
        sched.step()
        t2 = time.perf_counter()
        loss_sum += batch_loss_sum
        correct += batch_correct
        seen += len(labels)
        if on_step is not None:
            on_step(skip + steps, plan.first_step + steps, loss_sum)
        if cfg.log_every and (steps % cfg.log_every == 0 or steps == total):
            check_finite(float(loss_sum), plan.first_step + steps, opt.get_lr(), env)
            elapsed = time.perf_counter() - start
            now = {
                "loss": float(loss),
                "acc": float(batch_correct) / len(labels),
                "lr": opt.get_lr(),
                "images_per_sec": seen * env.world_size / elapsed,
                "input_wait_share": timer.seconds["input_wait"] / elapsed,
            }
            log.info(
                f"epoch {epoch + 1} step {steps}/{total} loss {now['loss']:.4f} lr {now['lr']:.5f} "
                f"{now['images_per_sec']:.0f} img/s (global)",
                extra={"step": plan.first_step + steps, "scalars": now},  # figures for --visualdl's handler
            )
        if bar.enabled:
            bar.update(steps, f"loss {float(loss):.4f}")
        timer.add("logging", time.perf_counter() - t2)
    batches.close()
    own = time.perf_counter() - start
    seconds = all_reduce_max(own, env)
    totals = all_reduce_sum([float(loss_sum), float(correct), seen], env)
    check_finite(totals[0], plan.first_step + steps, opt.get_lr(), env)
    images = int(totals[2])
    return EpochStats(
        loss=totals[0] / max(images, 1),
        acc=totals[1] / max(images, 1),
        images=images,
        steps=steps,
        seconds=seconds,
        input_wait=timer.seconds["input_wait"],
        own_seconds=own,
        phase_shares=timing.shares(timer.seconds, timer.samples, steps, own),
        samples=timer.samples,
    )


def amp_context(cfg: Config):
    """auto_cast for --amp fp16/bf16; a context that changes nothing when it is off."""
    if cfg.amp == "off":
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(dtype={"fp16": "float16", "bf16": "bfloat16"}[cfg.amp], level="O1")


def make_scaler(cfg: Config) -> paddle.amp.GradScaler | None:
    """float16 gradients underflow without loss scaling; bfloat16 has float32's range and needs none."""
    return paddle.amp.GradScaler(init_loss_scaling=2.0**15) if cfg.amp == "fp16" else None


def train_step(model, opt, scaler, images: np.ndarray, labels: np.ndarray, cfg: Config, timer=None):
    """One optimizer step over --accum-steps micro-batches; (last micro-batch loss, summed loss, correct).

    Each micro-batch's mean loss is divided by the number of micro-batches, so the accumulated gradient is the
    mean over the worker's whole batch, as without accumulation; gradients are all-reduced only in the last
    backward pass (DataParallel's no_sync for the others). With a timing.StepTimer the step's phases are timed:
    every backward pass then runs under no_sync and the gradients are averaged afterwards, on their own.
    """
    k = cfg.accum_steps
    loss_sums, corrects = [], []
    if timer:
        timer.begin()
    for i, (xs, ys) in enumerate(zip(np.split(images, k), np.split(labels, k))):
        x, y = paddle.to_tensor(xs), paddle.to_tensor(ys)
        with gradient_sync(model, i == k - 1 and timer is None):
            with amp_context(cfg):
                logits = model(x)
            if logits.dtype != paddle.float32:  # the loss in float32 whatever precision the network ran in
                logits = logits.astype("float32")
            loss = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
            part = loss / k if k > 1 else loss
            (scaler.scale(part) if scaler else part).backward()
        loss_sums.append(loss.detach() * len(ys))
        corrects.append((logits.argmax(axis=1) == y).astype("int64").sum())
    if timer:
        timer.mark("forward_backward")
        all_reduce_gradients(model)
        timer.mark("all_reduce")
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.clear_grad()
    if timer:
        timer.mark("optimizer")
    if k == 1:
        return loss, loss_sums[0], corrects[0]
    return loss, paddle.add_n(loss_sums), paddle.add_n(corrects)


def check_finite(loss_sum: float, step: int, lr: float, env: DistEnv) -> None:
    """Stop every worker together once any worker's loss is NaN or infinite (an all-reduce, so none is left waiting)."""
    bad = all_reduce_sum([0.0 if math.isfinite(loss_sum) else 1.0], env)[0]
    if bad:
        raise Diverged(
            f"the training loss became NaN or infinite by step {step} (learning rate {lr:.4g}); the likely cause is "
            "a learning rate too high for this batch size: lower --lr, and restart or --resume from the last "
            "checkpoint (it was saved before the loss diverged)"
        )


@paddle.no_grad()
def evaluate(model: paddle.nn.Layer, split: data.Split, ds: data.Dataset, cfg: Config, env: DistEnv) -> EvalStats:
    """Each worker scores its own disjoint shard; the sums are all-reduced, so every image counts once."""
    net = unwrap(model)
    net.eval()
    shard = data.eval_shard(len(split), env.rank, env.world_size)
    sums = np.zeros(3)
    for lo in range(shard.start, shard.stop, cfg.eval_batch_size):
        idx = np.arange(lo, min(lo + cfg.eval_batch_size, shard.stop))
        images, labels = next(data.batches(split, ds, [idx]))
        x, y = paddle.to_tensor(images), paddle.to_tensor(labels)
        logits = net(x)
        if cfg.tta:  # the mirror image's output counts as much as the image's own
            logits = (logits + net(paddle.flip(x, axis=[3]))) / 2
        sums += (
            float((logits.argmax(axis=1) == y).astype("int64").sum()),
            float(F.cross_entropy(logits, y, reduction="sum")),
            len(idx),
        )
    correct, loss_sum, count = all_reduce_sum(sums, env)
    return EvalStats(loss=loss_sum / count, acc=correct / count, count=int(count))
