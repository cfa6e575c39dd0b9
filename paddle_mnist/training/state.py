"""What training carries from step to step, built once, and what a checkpoint holds of it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import paddle

from paddle_mnist.config import FOLDER, Config, ConfigError, effective_lr
from paddle_mnist.files import checkpoint
from paddle_mnist.network.models import build_model, sums_exactly
from paddle_mnist.ops import onednn
from paddle_mnist.runtime import distributed
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training import rng
from paddle_mnist.training.ema import WeightAverage
from paddle_mnist.training.lookahead import Lookahead


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
    # Paddle clips before it adds the weight decay, as torch.nn.utils.clip_grad_norm_ does before the step
    clip = paddle.nn.ClipGradByGlobalNorm(cfg.clip_grad_norm) if cfg.clip_grad_norm else None
    opt = paddle.optimizer.Momentum(
        learning_rate=sched,
        momentum=cfg.momentum,
        parameters=model.parameters(),
        use_nesterov=cfg.nesterov,
        weight_decay=decay,
        grad_clip=clip,
    )
    return opt, sched


RESUME_FIX = "pass another --output-dir, or --overwrite to start afresh"
RESUME_KEYS = ("model", "dataset", "batch_size", "image_size", "channels")  # a resume must keep these flags
# a resume may change these; the learning-rate schedule is then planned anew from the checkpoint's step (replan)
SCHEDULE_KEYS = ("epochs", "warmup_epochs", "lr", "lr_schedule", "lr_scaling", "reference_batch")


def check_resumable(saved: dict, cfg: Config, path: Path) -> None:
    """Refuse, in one line, to continue from a checkpoint whose saved config differs from this run's in a flag the
    weights and data depend on (RESUME_KEYS, and a folder's --val-split, which chooses its training images) or in
    the dataset's classes. Keys an older checkpoint lacks are not compared."""
    keys = RESUME_KEYS + (("val_split",) if cfg.dataset == FOLDER else ())
    for key in keys:
        if key in saved and saved.get(key) != getattr(cfg, key):
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                f"--resume: {path} was trained with {flag} {saved.get(key)}, not {getattr(cfg, key)}; "
                f"pass {flag} {saved.get(key)} or another --output-dir"
            )
    if "classes" in saved and list(saved["classes"]) != list(cfg.classes):
        raise ConfigError(
            f"--resume: {path} was trained on the classes {', '.join(saved['classes'])}, and the data now has "
            f"{', '.join(cfg.classes)}; restore the data's class folders, or pass another --output-dir"
        )


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
        self.untrained: dict[str, list] = {"model": [], "ema": []}  # every rank's statistics, from a stop's checkpoint
        self.lookahead = Lookahead(model) if cfg.lookahead else None
        # a step's gradient summed in float64 (network/exact.py): where oneDNN's convolutions run in float32 and
        # every trained layer can hand its gradient over in float64
        self.exact = onednn.active() and cfg.amp == "off" and sums_exactly(model)

    @classmethod
    def create(
        cls,
        cfg: Config,
        num_classes: int,
        image_shape: tuple,
        env: DistEnv,
        steps_per_epoch: int,
        whitening=None,
        start=None,
    ):
        """The same seed on every rank: the same initial weights everywhere. The schedule is planned over --epochs;
        --max-steps only stops early, so a stopped run can be resumed exactly. whitening: with --whiten, a function
        that whitens the model's first convolution (whiten.whiten with the training images bound). start: with
        --init-from or --pretrained, a function that loads what fits into the model and returns the names it
        loaded (finetune.start), after the whitening, so loaded weights win, and before the moving average and
        the slow copy are taken of the model."""
        paddle.seed(cfg.seed)
        np.random.seed(cfg.seed)
        model = build_model(cfg.model, num_classes, image_shape)
        if whitening is not None:
            whitening(model)
        loaded = start(model) if start is not None else ()
        if cfg.sync_bn:
            model = distributed.convert_sync_bn(model, env)
        planned = cfg.epochs * steps_per_epoch
        opt, sched = make_optimizer(cfg, model, planned, round(cfg.warmup_epochs * steps_per_epoch))
        ema = WeightAverage(model, build_model(cfg.model, num_classes, image_shape), cfg.ema) if cfg.ema else None
        return cls(cfg, model, opt, sched, make_scaler(cfg), ema, planned, loaded)

    def replan(self, saved: dict) -> str | None:
        """After restore: when the checkpoint's config planned its schedule with other SCHEDULE_KEYS (a finished
        run extended with a larger --epochs), the schedule is this run's plan from the step reached, and the
        learning rate of the next step is the new plan's (the checkpoint's would otherwise serve one more step).
        The line that says so and what the rate does; None when the plan is the checkpoint's."""
        changed = [k for k in SCHEDULE_KEYS if k in saved and saved[k] != getattr(self.cfg, k)]
        if not changed:
            return None
        before = float(self.sched.last_lr)
        self.sched.step(self.step)  # recomputes the rate at this step from the plan built for this run's flags
        after, end = float(self.sched.last_lr), self.planned_steps
        flags = ", ".join(f"--{k.replace('_', '-')} {getattr(self.cfg, k)} (was {saved[k]})" for k in changed)
        if self.step >= end:
            then = f"the new plan ended at step {end}: nothing is left to train"
        elif self.cfg.lr_schedule == "poly":
            then = f"it decays linearly to 0 at step {end}"
        else:
            then = "it stays there"
        return (
            f"schedule re-planned from step {self.step} over {self.cfg.epochs} epochs ({end} steps), for {flags}: "
            f"the learning rate goes from {before:.5g} to {after:.5g} and {then}"
        )

    @property
    def scored(self) -> paddle.nn.Layer:
        """What is evaluated, saved as model.pdparams and exported: the moving average when there is one."""
        return self.ema.net if self.ema else self.model

    def start(self, env: DistEnv) -> None:
        """Wrap the network in DataParallel (which broadcasts rank 0's weights), then give each rank back its own
        batch norm statistics if a stop's checkpoint kept them."""
        self.model = distributed.wrap(self.model, env)
        distributed.set_untrained(self.model, self.untrained["model"], env)
        if self.ema:
            distributed.set_untrained(self.ema.net, self.untrained["ema"], env)

    def end_epoch(self, batches_per_epoch: int) -> None:
        if self.batch_in_epoch == batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def contents(self, elapsed_s: float, rng_by_rank: list[dict]) -> dict:
        """The checkpoint: everything to continue bit for bit. elapsed_s is the training time up to here, summed
        over the sessions of a resumed run; rng_by_rank every rank's rng.current(), from gather_rng. A stop's
        checkpoint adds every rank's statistics (untrained_by_rank)."""
        return {
            "model": distributed.unwrap(self.model).state_dict(),
            "ema": self.ema.state_dict() if self.ema else None,
            "lookahead": self.lookahead.state_dict() if self.lookahead else None,
            "optimizer": self.opt.state_dict(),
            "lr_scheduler": self.sched.state_dict(),
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "step": self.step,
            "rng": {"by_rank": rng_by_rank, "numpy": np.random.get_state()},
            "config": dataclasses.asdict(self.cfg),
            "scaler": self.scaler.state_dict() if self.scaler else None,  # fp16 loss scale, so a resumed run keeps it
            "elapsed_s": elapsed_s,
            "best": self.best,
            "loaded": list(self.loaded),  # their learning rate follows --init-lr-scale and --freeze-epochs
        }

    @staticmethod
    def gather_rng(env: DistEnv) -> list[dict]:
        """Every rank's own generator states, for contents(); every rank must call it."""
        return distributed.gather_objects(rng.current(env.device), env)

    def restore(self, contents: dict, path: Path, env: DistEnv) -> str | None:
        """Continue from a checkpoint's contents; a warning line when its RNG states do not fit this job."""
        check_resumable(contents.get("config", {}), self.cfg, path)
        checkpoint.set_weights(self.model, contents["model"], path, RESUME_FIX)
        self.untrained = {  # set in start(), after DataParallel has broadcast rank 0's
            "model": contents.get("untrained_by_rank") or [],
            "ema": contents.get("ema_untrained_by_rank") or [],
        }
        self.opt.set_state_dict(contents["optimizer"])
        self.sched.set_state_dict(contents["lr_scheduler"])
        if self.scaler and contents.get("scaler"):
            self.scaler.load_state_dict(contents["scaler"])
        if self.ema:  # a checkpoint from before --ema was turned on starts the average from its weights
            checkpoint.set_weights(self.ema.net, contents.get("ema") or contents["model"], path, RESUME_FIX)
        if self.lookahead:  # likewise a checkpoint from before --lookahead: the slow copy starts as its weights
            saved = contents.get("lookahead") or contents["model"]
            try:
                self.lookahead.set_state_dict(saved, str(path))
            except ValueError as error:
                raise checkpoint.CheckpointError(f"{error}; {RESUME_FIX}") from None
        saved_rng = contents["rng"]
        chosen, warning = rng.to_restore(saved_rng["by_rank"], env.rank, env.world_size, env.device)
        rng.apply(chosen, env.device)
        np.random.set_state(saved_rng["numpy"])
        self.epoch, self.batch_in_epoch, self.step = (int(contents[k]) for k in ("epoch", "batch_in_epoch", "step"))
        self.trained_before = float(contents["elapsed_s"])
        self.best = contents["best"]
        self.loaded = tuple(contents.get("loaded") or ())
        return warning
