"""What training carries from step to step, built once (what a checkpoint holds of it: training/checkpoints.py)."""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import paddle

from paddle_mnist.config import Config, effective_lr
from paddle_mnist.network import batchnorm
from paddle_mnist.network.models import build_model, sums_exactly
from paddle_mnist.ops import onednn
from paddle_mnist.runtime import distributed
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training.ema import WeightAverage
from paddle_mnist.training.lookahead import Lookahead


def make_schedule(cfg: Config, total_steps: int, warmup_steps: int) -> paddle.optimizer.lr.LRScheduler:
    """Linear warmup from 0 (if any), then poly (power 1: linear to 0 at the last planned step), cosine (half a
    cosine from the peak to 0 at the last planned step, computed afresh each step: nothing carried that a resume could
    lose) or constant."""
    peak = effective_lr(cfg)
    decay_steps = max(total_steps - warmup_steps, 1)
    if cfg.lr_schedule == "cosine":
        sched = paddle.optimizer.lr.LambdaDecay(peak, functools.partial(_half_cosine, decay_steps))
    else:
        end = 0.0 if cfg.lr_schedule == "poly" else peak  # constant: a decay from peak to peak
        sched = paddle.optimizer.lr.PolynomialDecay(peak, decay_steps=decay_steps, end_lr=end, power=1.0)
    if warmup_steps:
        sched = paddle.optimizer.lr.LinearWarmup(sched, warmup_steps=warmup_steps, start_lr=0.0, end_lr=peak)
    return sched


def _half_cosine(decay_steps: int, step: int) -> float:
    """The share of the peak rate `step` steps into the decay: 1 at 0, 0 at decay_steps and after."""
    return 0.5 * (1.0 + math.cos(math.pi * min(step, decay_steps) / decay_steps))


def decays(param: paddle.Tensor) -> bool:
    """Whether AdamW's weight decay falls on this parameter: weights of convolutions and linear layers, not the
    biases and batch norm's scales and shifts (vectors), as timm and PaddleClas leave them."""
    return len(param.shape) > 1


def make_optimizer(cfg: Config, model: paddle.nn.Layer, total_steps: int, warmup_steps: int = 0):
    sched = make_schedule(cfg, total_steps, warmup_steps)
    # Paddle clips before it adds the weight decay, as torch.nn.utils.clip_grad_norm_ does before the step
    clip = paddle.nn.ClipGradByGlobalNorm(cfg.clip_grad_norm) if cfg.clip_grad_norm else None
    if cfg.optimizer == "adamw":
        vectors = {p.name for p in model.parameters() if not decays(p)}
        opt = paddle.optimizer.AdamW(
            learning_rate=sched,
            parameters=model.parameters(),
            weight_decay=cfg.weight_decay,
            apply_decay_param_fun=lambda name: name not in vectors,
            grad_clip=clip,
        )
        return opt, sched
    decay = paddle.regularizer.L2Decay(cfg.weight_decay) if cfg.weight_decay else None
    opt = paddle.optimizer.Momentum(
        learning_rate=sched,
        momentum=cfg.momentum,
        parameters=model.parameters(),
        use_nesterov=cfg.nesterov,
        weight_decay=decay,
        grad_clip=clip,
    )
    return opt, sched


def balanced_weights(labels, num_classes: int) -> np.ndarray:
    """--class-weights balanced: n / (classes x the class's images) for each class of the n training labels (0 for
    a class without any), so that every class's images weigh as much in all as any other's."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes).astype(np.float64)
    weights = np.divide(len(labels), num_classes * counts, out=np.zeros(num_classes), where=counts > 0)
    return weights.astype(np.float32)


def make_scaler(cfg: Config) -> paddle.amp.GradScaler | None:
    """float16 gradients underflow without loss scaling; bfloat16 has float32's range and needs none."""
    return paddle.amp.GradScaler(init_loss_scaling=2.0**15) if cfg.amp == "fp16" else None


class TrainState:
    """The network, its optimizer, learning-rate schedule, fp16 loss scaler and moving average, and where training
    stands: `epoch` whole epochs done, `batch_in_epoch` batches of the next one done, `step` optimizer steps done.

    Also what a resumed run carries over: the seconds trained in earlier sessions, the best epoch so far, and
    every rank's batch norm statistics when the checkpoint was a stop's.
    """

    def __init__(
        self,
        cfg: Config,
        model,
        opt,
        sched,
        scaler,
        ema: WeightAverage | None,
        planned_steps: int = 0,
        loaded: tuple[str, ...] = (),
    ):
        self.cfg, self.model, self.opt, self.sched, self.scaler, self.ema = cfg, model, opt, sched, scaler, ema
        self.planned_steps = planned_steps  # the schedule's length: --epochs x steps per epoch
        self.loaded = loaded  # the tensors --init-from or --pretrained loaded, which train at their own rate
        self.epoch = self.batch_in_epoch = self.step = 0
        self.trained_before = 0.0  # seconds of training in earlier sessions of this run
        self.best: dict | None = (
            None  # the epoch of highest validation accuracy: epoch, step, val_acc, val_loss, digest
        )
        # every rank's batch norm statistics, from a stop's checkpoint
        self.running_statistics: dict[str, list] = {"model": [], "ema": []}
        self.lookahead = Lookahead(model) if cfg.lookahead else None
        self.class_weights: paddle.Tensor | None = None  # each class's weight in the training loss (float32)
        # a step's gradient summed in float64 (network/exact.py): where oneDNN's convolutions run in float32 and
        # every trained layer can hand its gradient over in float64; PADDLE_MNIST_SUMS=float32 turns it off, to
        # price it (scripts/bench_torch's trainer-f32 contender)
        wide = os.environ.get("PADDLE_MNIST_SUMS") != "float32"
        self.exact = wide and onednn.active() and cfg.amp == "off" and sums_exactly(model)

    @classmethod
    def create(
        cls,
        cfg: Config,
        num_classes: int,
        image_shape: tuple,
        env: DistEnv,
        steps_per_epoch: int,
        whitening=None,
        load_weights=None,
        train_labels=None,
    ):
        """The same seed on every rank: the same initial weights everywhere. The schedule is planned over --epochs;
        --max-steps only stops early, so a stopped run can be resumed exactly. whitening: with --whiten, a function
        that whitens the model's first convolution (whiten.whiten with the training images bound). load_weights: with
        --init-from or --pretrained, a function that loads what fits into the model and returns the names it
        loaded (finetune.weights_loader), after the whitening, so loaded weights win, and before the moving average and
        the slow copy are taken of the model. train_labels: with --class-weights balanced, the training split's."""
        paddle.seed(cfg.seed)
        np.random.seed(cfg.seed)
        model = build_model(cfg.model, num_classes, image_shape)
        if whitening is not None:
            whitening(model)
        loaded = load_weights(model) if load_weights is not None else ()
        if cfg.sync_bn and env.device == "cpu":  # one process too: it computes batch norm as the workers do
            batchnorm.over_global_batch(model)
        elif cfg.sync_bn:
            model = distributed.convert_sync_bn(model, env)
        planned = cfg.epochs * steps_per_epoch
        opt, sched = make_optimizer(cfg, model, planned, round(cfg.warmup_epochs * steps_per_epoch))
        ema = WeightAverage(model, build_model(cfg.model, num_classes, image_shape), cfg.ema) if cfg.ema else None
        state = cls(cfg, model, opt, sched, make_scaler(cfg), ema, planned, loaded)
        if cfg.class_weights == "balanced":
            state.class_weights = paddle.to_tensor(balanced_weights(train_labels, num_classes))
        return state

    @property
    def evaluated_model(self) -> paddle.nn.Layer:
        """What is evaluated, saved as model.pdparams and exported: the moving average when there is one."""
        return self.ema.net if self.ema else self.model

    def join_workers(self, env: DistEnv) -> None:
        """Wrap the network in DataParallel (which broadcasts rank 0's weights), then give each rank back its own
        batch norm statistics if a stop's checkpoint kept them."""
        self.model = distributed.wrap(self.model, env, self.cfg.cpu_sums, 8 if self.exact else 4)
        distributed.set_running_statistics(self.model, self.running_statistics["model"], env)
        if self.ema:
            distributed.set_running_statistics(self.ema.net, self.running_statistics["ema"], env)

    def average_statistics(self, env: DistEnv) -> None:
        """Every rank's batch norm statistics averaged (every rank takes part), so every rank then holds the ones rank
        0 saves and evaluates with."""
        if batchnorm.spans_global_batch(distributed.unwrap(self.model)):
            return  # every rank's are the same bits already, which an average over 3 ranks could round away
        distributed.average_running_statistics(self.model, env)
        if self.ema:
            distributed.average_running_statistics(self.ema.net, env)

    def advance(self) -> None:
        """One optimizer step taken: the schedule and the position move on."""
        self.sched.step()
        self.step += 1
        self.batch_in_epoch += 1

    def end_epoch(self, batches_per_epoch: int) -> None:
        if self.batch_in_epoch == batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
