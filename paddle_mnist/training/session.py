"""What a run does around its training steps: where all ranks meet (stop signals, failed writes), when to ask for a
checkpoint, the epoch's row and log lines, the watchdog, the profiler window, and whether it learned anything."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from paddle_mnist.config import Config, profile_window, tta_each_epoch
from paddle_mnist.files import events
from paddle_mnist.files.log import memory_mb
from paddle_mnist.runtime import distributed, preempt
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.runtime.preempt import Preempted, StopSignals
from paddle_mnist.runtime.watchdog import Watchdog
from paddle_mnist.training import chance, engine, timing
from paddle_mnist.training.checkpoints import Checkpoints
from paddle_mnist.training.outputs import RunFiles
from paddle_mnist.training.profiling import ProfileWindow
from paddle_mnist.training.state import TrainState


def stopped(
    signum: int, step: int, where: str, saved: Path | None, sender: tuple[int, bool] | None = None
) -> Preempted:
    """sender: where another rank took the signal, that rank and whether its launcher had gone away
    (Session.sender), else None."""
    kept = f"checkpoint {saved}" if saved else "nothing trained yet, so no checkpoint"
    took, said = None, ""
    if sender is not None:
        took, orphaned = sender
        said = f"; rank {took} took the signal{', its launcher having gone away' if orphaned else ''}, this rank none"
    return Preempted(
        signum,
        f"stopped by {preempt.signal_name(signum)} at step {step} ({where}{said}); {kept}; "
        f"continue with: {preempt.resume_command()}",
        took,
    )


def epoch_row(cfg: Config, env: DistEnv, state: TrainState, stats: engine.EpochStats, val) -> dict:
    """One line of metrics.jsonl."""
    clipping = (
        {"clipped_share": stats.clipped_share, "grad_norm": stats.grad_norm, "skipped_steps": stats.skipped}
        if cfg.clip_grad_norm
        else {}
    )
    return {
        "epoch": state.epoch + 1,
        "step": state.step,
        "train_loss": stats.loss,
        "train_acc": stats.acc,
        "val_loss": val.loss,
        "val_acc": val.acc,
        "val_count": val.count,
        "images_per_sec": stats.images_per_sec,
        "epoch_time_s": stats.seconds,
        "input_wait_share": stats.input_wait / stats.seconds if stats.seconds else 0.0,
        "step_time_shares": stats.phase_shares,  # rank 0's; every rank logs its own
        "world_size": env.world_size,
        "global_batch_size": cfg.batch_size,
        "lr": state.opt.get_lr(),
        "rss_mb": memory_mb()[0],
        "time_s": timing.since_command_start(),  # seconds since the command (the launcher, if any) started
        **clipping,
    }


def log_epoch(
    log: logging.Logger, cfg: Config, row: dict, stats: engine.EpochStats, cut: tuple[int, int] | None = None
) -> None:
    """The epoch's lines; cut: (batches trained, batches per epoch) when --max-steps ended training mid-epoch."""
    step_ms = 1000 * stats.own_seconds / max(stats.steps, 1)
    shares = timing.describe(stats.phase_shares, step_ms, stats.samples, row["world_size"])
    log.info(f"epoch {row['epoch']} time per {shares}")
    # logs.py reads "epoch N/M done" and "epoch N/M stopped at --max-steps S"
    ended = f"stopped at --max-steps {cfg.max_steps} (batch {cut[0]} of {cut[1]})" if cut else "done"
    events.emit(
        "epoch",
        epoch=row["epoch"],
        epochs=cfg.epochs,
        max_steps=cfg.max_steps if cut else None,
        memory_mb=round(row["rss_mb"]),
    )
    log.info(
        f"epoch {row['epoch']}/{cfg.epochs} {ended}: train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f} | "
        f"val loss {row['val_loss']:.4f} acc {row['val_acc']:.4f} ({row['val_count']} images) | "
        f"{row['epoch_time_s']:.1f}s, {row['images_per_sec']:.0f} img/s global, "
        f"input wait {100 * row['input_wait_share']:.1f}%, memory {row['rss_mb']:.0f} MiB"
    )
    if cfg.clip_grad_norm:
        skipped = (
            f"; {stats.skipped} step(s) skipped with inf/NaN gradients (fp16 overflow), left out of these figures"
            if stats.skipped
            else ""
        )
        log.info(
            f"epoch {row['epoch']} gradient clipping at norm {cfg.clip_grad_norm:g}: clipped {stats.clipped} of "
            f"{stats.steps - stats.skipped} steps ({100 * stats.clipped_share:.0f}%), mean norm before clipping "
            f"{stats.grad_norm:.3f}{skipped}"
        )


class Session:
    """One session of a run, from the first meeting of the ranks to the last training step.

    Ranks meet (one all-reduce of five numbers, meet()) at every epoch end and every few mid-epoch steps (Cadence: about
    every quarter second): a stop signal that reached only some ranks, or a failed write on rank 0, then stops all
    of them at the same step, after a checkpoint. An epoch whose training loss is still at chance well after the
    warmup (chance.stall_judged) ends training too, after its checkpoint: `stalled` then holds the error's text.
    """

    def __init__(
        self,
        cfg: Config,
        env: DistEnv,
        log: logging.Logger,
        state: TrainState,
        files: RunFiles,
        checkpoints: Checkpoints,
        *,
        stop: StopSignals,
        batches_per_epoch: int,
        resumed: Path | None,
        levels: chance.LossLevels,
        eval_images: int,
        hooks: Sequence[Callable[[int, dict], object]] = (),
    ):
        self.cfg, self.env, self.log, self.state, self.files = cfg, env, log, state, files
        self.checkpoints = checkpoints
        self.stop, self.batches_per_epoch, self.resumed, self.levels = stop, batches_per_epoch, resumed, levels
        # the schedule's own count (paddle's LinearWarmup keeps it), so this follows however the warmup is planned
        self.warmup_steps = getattr(state.sched, "warmup_steps", 0)
        self.stalled: str | None = None
        self.ended_on_best = self.patience_spent()  # a resumed run that --patience had ended trains no more
        self.last_loss: float | None = None  # the last epoch's mean training loss, this session's
        planned = cfg.epochs * self.batches_per_epoch
        self.last_step = min(planned, cfg.max_steps) if cfg.max_steps else planned
        self.cadence = preempt.Cadence()
        self.watchdog = Watchdog(env, cfg.collective_timeout, log)
        self.profile = ProfileWindow(profile_window(cfg.profile_steps), cfg.output_dir, env, log)
        self.started = time.time()
        self.eval_images = eval_images  # one evaluation's, for the estimate of the run's time
        self.first_step = state.step  # this session's: a resumed run estimates only the steps it has left
        self.clock = timing.RunClock()
        # set by meet(): which rank took the stop signal, where this one took none, and whether its launcher went away
        self.sender: tuple[int, bool] | None = None
        self.hooks = hooks  # train()'s callbacks, on_epoch_end(epoch, metrics): a true return ends the run

    def __enter__(self) -> Session:
        if signum := self.meet(self.state.step):  # a signal during start-up: data, model, checkpoint loading
            raise stopped(signum, self.state.step, "before training", self.resumed, self.sender)
        self.started = time.time() - self.state.trained_before  # wall time covers every session of the run
        self.profile.begin(self.state.step)
        self.watchdog.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.watchdog.__exit__(*exc)
        if exc[0] is None:
            self.profile.finish()  # training ended inside the window: write what was recorded

    def training(self) -> bool:
        return self.state.epoch < self.cfg.epochs and self.state.step < self.last_step and not self.ended_on_best

    def patience_spent(self) -> bool:
        """--patience: the best validation accuracy so far is that many epochs old. Rank 0's count decides for all
        (on resume it alone checks model_best.pdparams, and may start the count again)."""
        if not self.cfg.patience:
            return False
        best = self.state.best
        spent = bool(best) and self.state.epoch - best["epoch"] >= self.cfg.patience
        return bool(distributed.all_reduce_max_values([spent and self.env.is_main], self.env)[0])

    def batch_count(self) -> int:
        """Batches the next epoch trains: the rest of the epoch, or fewer if --max-steps comes first."""
        return min(self.batches_per_epoch - self.state.batch_in_epoch, self.last_step - self.state.step)

    def elapsed(self) -> float:
        return time.time() - self.started

    def meet(self, at_step: int) -> int:
        """All stop if rank 0's last write failed; else the agreed stop signal (0: none). A rank that took none
        learns which rank did (the highest) and whether that rank's launcher went away, for its stop line."""
        mine = self.env.rank + 1
        orphan = self.stop.launcher is not None and self.stop.launcher.gone()
        shared = [self.stop.signum, self.checkpoints.failed(), self.cadence.seconds_per_step(at_step)]
        shared += [mine if self.stop.signum else 0, mine if orphan else 0]
        signum, failed, per_step, took, orphaned = distributed.all_reduce_max_values(shared, self.env)
        if failed:
            raise self.checkpoints.failure()
        self.cadence.plan(at_step, per_step)
        if signum:
            self.stop.explain()
            if not self.stop.signum and took:
                self.sender = (int(took) - 1, orphaned == took)
        return int(signum)

    def after_step(self, loss_sum) -> None:
        state, cfg = self.state, self.cfg
        self.clock.step()
        if self.clock.steps == timing.ESTIMATE_AFTER and self.env.is_main:
            self.log.info(self.estimate())
        self.watchdog.progress(state.step)
        self.profile.after_step(state.step)
        if state.lookahead:
            state.lookahead.update(state.step, state.planned_steps)
        if state.ema:
            state.ema.update(state.step)
        every = cfg.save_every_steps
        inside = state.batch_in_epoch < self.batches_per_epoch
        saved = every and state.step % every == 0 and inside
        if saved:
            self.checkpoints.save_mid_epoch(state, loss_sum, self.started, for_stop=False)
        # the step that ends the epoch or the run is followed by the epoch end, which meets anyway
        meeting = inside and state.step < self.last_step and self.cadence.due(state.step)
        if meeting and (signum := self.meet(state.step)):
            if not saved:
                self.checkpoints.save_mid_epoch(state, loss_sum, self.started, for_stop=True)
                self.meet(state.step)  # a failed save stops every rank with the write error
            where = f"epoch {state.epoch + 1}, batch {state.batch_in_epoch} of {self.batches_per_epoch}"
            raise stopped(signum, state.step, where, self.checkpoints.path(state.step), self.sender)

    def estimate(self) -> str:
        """This session's time from its first step to its last epoch's end (training and evaluation; not start-up,
        a separate test split's score or the export), from the steps and epoch ends timed so far."""
        cfg, state, clock, per_epoch = self.cfg, self.state, self.clock, self.batches_per_epoch
        per_step = clock.step_seconds / max(clock.steps, 1)
        steps_left = self.last_step - state.step
        ends = timing.epoch_ends_left(state.batch_in_epoch, per_epoch, steps_left)
        if clock.ends:
            per_end = clock.end_seconds / clock.ends
            rates = f"{timing.step_text(per_step)} a step, {timing.duration_text(per_end)} an evaluation so far"
        else:  # forward passes only, sharded like training; --tta's views each epoch only with --target-acc
            views = (6 if cfg.tta_shift else 2) if tta_each_epoch(cfg) else 1
            per_end = per_step * self.eval_images / cfg.batch_size * timing.EVAL_COST * views
            guessed = timing.duration_text(per_end)
            rates = f"{timing.step_text(per_step)} a step so far, an evaluation guessed at {guessed}"
        left = steps_left * per_step + ends * per_end
        total = clock.so_far() + left
        evaluations = self._evaluations(ends + clock.ends)
        now = time.time()
        return (
            f"estimated time: {timing.duration_text(total)} for {self._steps_text()}{evaluations} ({rates}); "
            f"ends about {timing.clock_text(now + left, now)}"
        )

    def _steps_text(self) -> str:
        """The steps this session trains, as the plan and --max-steps make them."""
        cfg, per_epoch = self.cfg, self.batches_per_epoch
        planned, steps = cfg.epochs * per_epoch, self.last_step - self.first_step
        if self.first_step and self.last_step < planned:
            return f"the {steps} steps left to --max-steps {cfg.max_steps}"
        if self.first_step:
            return f"the {steps} steps left of {cfg.epochs} epochs of {per_epoch}"
        if self.last_step < planned:
            return f"{steps} steps (--max-steps; {cfg.epochs} epochs would be {planned})"
        return f"{cfg.epochs} epochs of {per_epoch} steps"

    def _evaluations(self, count: int) -> str:
        if not self.eval_images:
            return ""
        return f" and {count} evaluation{'s' if count > 1 else ''} of {self.eval_images} images"

    def end_epoch(self, stats: engine.EpochStats, val) -> bool:
        """Log and record the epoch, keep the best model, checkpoint, meet. True: --target-acc was reached, or the
        training loss stalled at chance (`stalled`)."""
        state, cfg = self.state, self.cfg
        self.watchdog.progress(state.step)
        row = epoch_row(cfg, self.env, state, stats, val)
        # an epoch ends short of its batches only where --max-steps comes first
        cut = (state.batch_in_epoch, self.batches_per_epoch) if state.batch_in_epoch < self.batches_per_epoch else None
        log_epoch(self.log, cfg, row, stats, cut)
        self.last_loss = stats.loss
        engine.check_weights(state)  # the loss was checked, on every rank, at the end of the epoch
        self.files.append_metrics(row)
        state.end_epoch(self.batches_per_epoch)
        self.checkpoints.save_epoch_end(state, val, row["epoch"], self.started)
        self.clock.epoch_end()
        if signum := self.meet(state.step):  # a signal during evaluation or the checkpoint write stops here
            where = f"end of epoch {row['epoch']}"
            raise stopped(signum, state.step, where, self.checkpoints.path(state.step), self.sender)
        if cfg.target_acc and val.acc >= cfg.target_acc:  # the same figure on every rank: all stop here
            self.log.info(f"reached --target-acc {cfg.target_acc:g}: accuracy {val.acc:.4f} after epoch {row['epoch']}")
            return True
        if self.hooks and self._hooks_end_run(row):
            return True
        if self.patience_spent():
            best = state.best
            self.log.info(
                f"--patience {cfg.patience}: no higher validation accuracy since epoch {best['epoch']} "
                f"({best['val_acc']:.4f}); the run ends on that epoch's weights"
            )
            self.ended_on_best = True
            return True
        # the loss is summed over all workers and the steps are the same everywhere: every rank stops here alike
        if chance.stall_judged(state.step - stats.steps, self.warmup_steps) and self.levels.stalled(stats.loss):
            self.stalled = chance.stall_message(self.levels, stats.loss, state.step, row["epoch"], cfg.output_dir)
            return True
        return False

    def _hooks_end_run(self, row: dict) -> bool:
        """Whether a callback ended the run after this epoch, on any rank (then on every one: the ranks agree)."""
        metrics = json.loads(json.dumps(row))  # as metrics.jsonl holds it: plain numbers, a copy for each hook
        asked = any([bool(hook(row["epoch"], metrics)) for hook in self.hooks])  # every hook runs
        if not distributed.all_reduce_max_values([asked], self.env)[0]:
            return False
        self.log.info(
            f"a callback ended the run after epoch {row['epoch']}; its checkpoint is kept: resume='auto' trains on"
        )
        return True

    def verdict(self, acc: float, level: chance.AccuracyLevel) -> chance.Verdict:
        """Whether the run learned anything, from its final test accuracy (or its stall); a warning when the
        accuracy is at chance after too few steps to judge."""
        step = self.state.step
        judged = chance.judge(acc, level, step, self.warmup_steps, self.stalled is not None)
        if judged is None and level.at_chance(acc) and level.bound < 1:
            self.log.warning(
                f"warning: the test accuracy {acc:.4f} is no better than chance ({level.share:.4f}, {level.bound:.4f} "
                f"with {chance.Z:g} standard errors) after {step} steps, too few to judge the run by "
                f"({chance.JUDGE_STEPS} after the warmup): train longer"
            )
        message = self.stalled
        if judged and not message:
            loss, level_loss = self.last_loss, self.levels.chance
            trained = "" if loss is None else f" (training loss {loss:.3f}, chance {level_loss:.3f})"
            message = chance.final_message(level, acc, step, trained, self.cfg.output_dir)
        return chance.Verdict(judged, message, level)
