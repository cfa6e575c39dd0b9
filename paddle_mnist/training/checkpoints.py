"""A run's checkpoints, with one owner: what a checkpoint holds, when one is written (epoch end, every
--save-every-steps, on a stop signal), the best weights, the newest --keep-checkpoints kept, damaged ones set aside,
the one a resume continues from, and whether a write failed.

The session asks Checkpoints; Checkpoints asks nothing of the session. Rank 0 alone writes, through RunFiles (the
only writer of the run's files); the file format (atomic, digested, read by the restricted unpickler) is
files/checkpoint.py's, and the generator states per rank rng.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import numpy as np

from paddle_mnist.config import FOLDER, Config, ConfigError
from paddle_mnist.files import checkpoint, events
from paddle_mnist.runtime import distributed
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.training import engine, rng
from paddle_mnist.training.outputs import BEST_WEIGHTS, RunFiles, WriteFailed
from paddle_mnist.training.state import TrainState

RESUME_FIX = "pass another --output-dir, or --overwrite to start afresh"
# a resume must keep these flags
RESUME_KEYS = ("model", "dataset", "batch_size", "image_size", "channels", "optimizer")
# a resume may change these; the learning-rate schedule is then planned anew from the checkpoint's step (replan)
SCHEDULE_KEYS = ("epochs", "warmup_epochs", "lr", "lr_schedule", "lr_scaling", "reference_batch")
DECAYS = {"poly": "linearly", "cosine": "along a half cosine"}  # how a schedule's rate falls to 0, for the replan line


def check_resumable(saved: dict, cfg: Config, path: Path) -> None:
    """Refuse, in one line, to continue from a checkpoint whose saved config differs from this run's in a flag the
    weights and data depend on (RESUME_KEYS, and a folder's --val-split, which chooses its training images) or in
    the dataset's classes. Keys an older checkpoint lacks are not compared."""
    keys = RESUME_KEYS + (("val_split",) if cfg.dataset == FOLDER else ())
    for key in keys:
        if key in saved and saved.get(key) != getattr(cfg, key):
            flag = "--opt" if key == "optimizer" else "--" + key.replace("_", "-")
            raise ConfigError(
                f"--resume: {path} was trained with {flag} {saved.get(key)}, not {getattr(cfg, key)}; "
                f"pass {flag} {saved.get(key)} or another --output-dir"
            )
    if "classes" in saved and list(saved["classes"]) != list(cfg.classes):
        raise ConfigError(
            f"--resume: {path} was trained on the classes {', '.join(saved['classes'])}, and the data now has "
            f"{', '.join(cfg.classes)}; restore the data's class folders, or pass another --output-dir"
        )


class Checkpoints:
    """OUTPUT_DIR/checkpoints/step_NNNNNNNN.pdckpt and model_best.pdparams. Every rank calls every method alike
    (some gather from every rank); rank 0 alone writes.

    choose() -> Path | None     the newest intact checkpoint, for every rank; damaged ones set aside
    resume(state, path)         continue from it: weights, optimizer, generators, position, the best so far
    save_mid_epoch(state, ...)  every --save-every-steps inside an epoch, and on a stop signal
    save_epoch_end(state, ...)  the epoch's checkpoint, then the best weights when validation improved
    path(step)                  where the checkpoint of a step is
    failed(), failure()         whether a write of the run failed here; the error every rank raises once they agree
    """

    def __init__(self, cfg: Config, env: DistEnv, log: logging.Logger, files: RunFiles):
        self.cfg, self.env, self.log, self.files = cfg, env, log, files
        self.out = Path(cfg.output_dir)

    def path(self, step: int) -> Path:
        return checkpoint.checkpoint_path(self.out, step)

    # resuming

    def choose(self) -> Path | None:
        """The newest intact checkpoint, chosen by rank 0 for every rank; damaged ones are set aside with a warning.

        Intact: its SHA-256 matches and the restricted loader reads it. When checkpoints exist but none is intact,
        the run stops before anything is overwritten.
        """
        chosen, tried = self._newest_intact() if self.env.is_main and self.cfg.resume != "no" else (None, [])
        step, failed = distributed.all_reduce_max_values(
            [checkpoint.step_of(chosen) if chosen else -1, 1.0 if tried and not chosen else 0.0], self.env
        )
        if failed:
            folder = self.out / checkpoint.CKPT_DIR
            main = self.env.is_main
            what = f"tried, and set aside: {', '.join(tried)}" if main else "rank 0's log names what it tried"
            raise ConfigError(
                f"--resume: no intact checkpoint in {folder} ({what}); nothing was overwritten: restore a checkpoint, "
                "or start afresh with --overwrite and without --resume"
            )
        return self.path(int(step)) if step >= 0 else None

    def _newest_intact(self) -> tuple[Path | None, list[str]]:
        """(the newest checkpoint that passes checkpoint.load(), what was set aside on the way)."""
        tried = []
        for path in reversed(checkpoint.list_checkpoints(self.out)):
            try:
                checkpoint.load(path)
            except checkpoint.CheckpointError as e:
                aside = checkpoint.set_aside(path)
                self.log.warning(f"warning: {e}; set aside as {aside.name}, trying the next older checkpoint")
                tried.append(f"{path.name} ({aside.name})")
                continue
            return path, tried
        return None, tried

    def resume(self, state: TrainState, path: Path) -> None:
        """Continue from the checkpoint at path (before DataParallel wraps the network), then keep the best so far
        where model_best.pdparams still holds it."""
        contents = checkpoint.load(path)
        if warning := self._restore(state, contents, path):
            self.log.warning(warning)
        if replanned := self._replan(state, contents.get("config", {})):
            self.log.info(replanned)
        del contents  # the checkpoint's arrays are no longer needed
        self.log.info(f"resumed from {path}: epoch {state.epoch + 1}, batch {state.batch_in_epoch}, step {state.step}")
        self._check_best(state)

    def _restore(self, state: TrainState, contents: dict, path: Path) -> str | None:
        """Set state from a checkpoint's contents; a warning line when its RNG states do not fit this job."""
        check_resumable(contents.get("config", {}), state.cfg, path)
        checkpoint.set_weights(state.model, contents["model"], path, RESUME_FIX)
        state.running_statistics = {  # set in TrainState.join_workers(), after DataParallel broadcast rank 0's
            "model": _by_rank(contents, "running_statistics_by_rank"),
            "ema": _by_rank(contents, "ema_running_statistics_by_rank"),
        }
        state.opt.set_state_dict(contents["optimizer"])
        state.sched.set_state_dict(contents["lr_scheduler"])
        if state.scaler and contents.get("scaler"):
            state.scaler.load_state_dict(contents["scaler"])
        if state.ema:  # a checkpoint from before --ema was turned on starts the average from its weights
            checkpoint.set_weights(state.ema.net, contents.get("ema") or contents["model"], path, RESUME_FIX)
        if state.lookahead:  # likewise a checkpoint from before --lookahead: the slow copy starts as its weights
            saved = contents.get("lookahead") or contents["model"]
            try:
                state.lookahead.set_state_dict(saved, str(path))
            except ValueError as error:
                raise checkpoint.CheckpointError(f"{error}; {RESUME_FIX}") from None
        saved_rng = contents["rng"]
        chosen, warning = rng.to_restore(saved_rng["by_rank"], self.env.rank, self.env.world_size, self.env.device)
        rng.apply(chosen, self.env.device)
        np.random.set_state(saved_rng["numpy"])
        state.epoch, state.batch_in_epoch, state.step = (int(contents[k]) for k in ("epoch", "batch_in_epoch", "step"))
        state.trained_before = float(contents["elapsed_s"])
        state.best = contents["best"]
        state.loaded = tuple(contents.get("loaded") or ())
        return warning

    @staticmethod
    def _replan(state: TrainState, saved: dict) -> str | None:
        """After _restore: when the checkpoint's config planned its schedule with other SCHEDULE_KEYS (a finished
        run extended with a larger --epochs), the schedule is this run's plan from the step reached, and the
        learning rate of the next step is the new plan's (the checkpoint's would otherwise serve one more step).
        The line that says so and what the rate does; None when the plan is the checkpoint's."""
        cfg = state.cfg
        changed = [k for k in SCHEDULE_KEYS if k in saved and saved[k] != getattr(cfg, k)]
        if not changed:
            return None
        before = float(state.sched.last_lr)
        state.sched.step(state.step)  # recomputes the rate at this step from the plan built for this run's flags
        after, end = float(state.sched.last_lr), state.planned_steps
        flags = ", ".join(f"--{k.replace('_', '-')} {getattr(cfg, k)} (was {saved[k]})" for k in changed)
        if state.step >= end:
            then = f"the new plan ended at step {end}: nothing is left to train"
        elif cfg.lr_schedule in DECAYS:
            then = f"it decays {DECAYS[cfg.lr_schedule]} to 0 at step {end}"
        else:
            then = "it stays there"
        return (
            f"schedule re-planned from step {state.step} over {cfg.epochs} epochs ({end} steps), for {flags}: "
            f"the learning rate goes from {before:.5g} to {after:.5g} and {then}"
        )

    def _check_best(self, state: TrainState) -> None:
        """On resume (rank 0): keep the best-so-far the checkpoint records if model_best.pdparams still holds it.

        The checkpoint is written before model_best.pdparams, so a stop between the two leaves the checkpoint's best
        newer than the file; that best is then the checkpoint's own epoch, whose weights were just restored and are
        written again. Any other mismatch (the file deleted or replaced) restarts the count, with a warning.
        """
        best = state.best
        if not best or not self.files.enabled:
            return
        path = self.out / BEST_WEIGHTS
        try:
            if checkpoint.digest_state(checkpoint.load(path)) == best["digest"]:
                return
        except (OSError, checkpoint.CheckpointError):
            pass
        net = distributed.unwrap(state.evaluated_model)
        if best["step"] == state.step and checkpoint.digest(net) == best["digest"]:
            self.files.save_weights(net, BEST_WEIGHTS)
            return
        self.log.warning(
            f"warning: {path} does not hold the best epoch the checkpoint records (epoch {best['epoch']}, validation "
            f"accuracy {best['val_acc']:.4f}); the best model is chosen again from the epochs still to come"
        )
        state.best = None

    def restore_best(self, state: TrainState) -> None:
        """The best epoch's weights into the evaluated model on every rank: rank 0 reads model_best.pdparams and
        sends it (the other ranks may not see the file)."""
        path = self.out / BEST_WEIGHTS
        weights = checkpoint.load(path) if self.files.enabled else None
        if weights is not None:
            weights = {name: np.asarray(value) for name, value in weights.items()}
        weights = distributed.gather_objects(weights, self.env)[0]
        checkpoint.set_weights(distributed.unwrap(state.evaluated_model), weights, path)

    # saving

    def save_mid_epoch(self, state: TrainState, loss_sum, started: float, for_stop: bool) -> None:
        """A checkpoint inside an epoch (started: the run's start on the wall clock, over all its sessions).

        for_stop: a save an uninterrupted run does not make, so each rank's batch norm statistics are kept as they
        are (averaging them would change the final ones in the last bits), for the resumed run. Otherwise every
        rank averages them, so a resumed run restarts from the statistics it had, on every rank.
        """
        env = self.env
        if for_stop:
            extra = {"running_statistics_by_rank": distributed.gather_running_statistics(state.model, env)}
            if state.ema:
                extra["ema_running_statistics_by_rank"] = distributed.gather_running_statistics(state.ema.net, env)
        else:
            state.average_statistics(env)
            extra = {}
        rng_by_rank = self._gather_rng()
        # never let diverged weights push a good checkpoint out; the next loss check stops every rank
        if self.files.enabled and np.isfinite(float(loss_sum)) and engine.weights_finite(state.model):
            self._write({**self._contents(state, time.time() - started, rng_by_rank), **extra})

    def save_epoch_end(self, state: TrainState, val, epoch: int, started: float) -> None:
        """The checkpoint of an epoch just ended (state.end_epoch done), then model_best.pdparams when val, its
        validation score, is the best so far; a stop between the two is what _check_best mends."""
        improved = state.best is None or val.acc > state.best["val_acc"]
        if improved:
            net = distributed.unwrap(state.evaluated_model)
            digest = checkpoint.digest(net) if self.files.enabled else ""
            state.best = {"epoch": epoch, "step": state.step, "val_acc": val.acc, "val_loss": val.loss}
            state.best["digest"] = digest
        rng_by_rank = self._gather_rng()  # every rank's generators; rank 0 alone writes them
        if self.files.enabled:
            self._write(self._contents(state, time.time() - started, rng_by_rank))
            if improved:
                self.files.save_weights(net, BEST_WEIGHTS)

    def _gather_rng(self) -> list[dict]:
        """Every rank's own generator states; every rank must call it."""
        return distributed.gather_objects(rng.current(self.env.device), self.env)

    @staticmethod
    def _contents(state: TrainState, elapsed_s: float, rng_by_rank: list[dict]) -> dict:
        """The checkpoint: everything to continue bit for bit. elapsed_s is the training time up to here, summed
        over the sessions of a resumed run; rng_by_rank every rank's rng.current(). A stop's checkpoint adds every
        rank's statistics (running_statistics_by_rank)."""
        return {
            "model": distributed.unwrap(state.model).state_dict(),
            "ema": state.ema.state_dict() if state.ema else None,
            "lookahead": state.lookahead.state_dict() if state.lookahead else None,
            "optimizer": state.opt.state_dict(),
            "lr_scheduler": state.sched.state_dict(),
            "epoch": state.epoch,
            "batch_in_epoch": state.batch_in_epoch,
            "step": state.step,
            "rng": {"by_rank": rng_by_rank, "numpy": np.random.get_state()},
            "config": dataclasses.asdict(state.cfg),
            "scaler": state.scaler.state_dict() if state.scaler else None,  # fp16 loss scale, so a resume keeps it
            "elapsed_s": elapsed_s,
            "best": state.best,
            "loaded": list(state.loaded),  # their learning rate follows --init-lr-scale and --freeze-epochs
        }

    def _write(self, contents: dict) -> None:
        """Rank 0: the checkpoint of contents["step"], then drop the oldest beyond --keep-checkpoints."""
        path = self.path(contents["step"])
        if self.files.save_checkpoint(path, contents):
            with self.files.writing(path):
                for old in checkpoint.list_checkpoints(self.out)[: -self.cfg.keep_checkpoints]:
                    old.unlink(missing_ok=True)
                    checkpoint.digest_path(old).unlink(missing_ok=True)
                events.emit("checkpoint", step=contents["step"], path=os.path.abspath(path))

    # a failed write

    def failed(self) -> bool:
        """Whether a write of the run failed on this rank (rank 0's checkpoints, weights, metrics or any file)."""
        return self.files.failure is not None

    def failure(self) -> WriteFailed:
        """The error every rank raises once they agree a write failed: on rank 0 which file and why, and what was
        kept."""
        if not self.files.enabled:
            return WriteFailed(
                "rank 0 could not write a file of the run (the file and the reason are in its log, workerlog.0); "
                "stopping with it"
            )
        kept = checkpoint.list_checkpoints(self.out)
        last = f"the last good checkpoint {kept[-1]} is intact" if kept else "no checkpoint had been written yet"
        return WriteFailed(
            f"{self.files.failure}; {last} and no partial file was left. Free space or fix the cause, then continue "
            "with the same command and --resume auto"
        )


def _by_rank(contents: dict, key: str) -> list:
    """Every rank's statistics a stop's checkpoint kept under key, or under its name before 2026-11-28
    ("untrained" for "running_statistics"), so an older checkpoint still resumes."""
    return contents.get(key) or contents.get(key.replace("running_statistics", "untrained")) or []
