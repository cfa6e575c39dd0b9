"""The command line: parse, set up the workers, train, evaluate, save."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import paddle

from . import augment, checkpoint, cpu, data, distributed, engine, preempt, timing
from .config import Config, ConfigError, effective_lr, parse_args, resolve_for_world
from .distributed import DistEnv, LaunchError
from .ema import WeightAverage
from .lock import RunLock
from .log import get_logger, memory_mb
from .models import build_model, count_parameters
from .outputs import RunFiles, WriteFailed, output_dir_problem
from .preempt import Preempted, StopSignals
from .watchdog import Watchdog


def _agree_output_dir(cfg: Config, env: DistEnv, lock: RunLock, log: logging.Logger) -> None:
    """Rank 0 takes the run's lock and judges --output-dir; every rank learns the verdict, so no worker waits on
    one that quit. The lock is the whole job's: the other ranks, on this node or others, share rank 0's."""
    problem = (lock.acquire() or output_dir_problem(cfg)) if env.is_main else None
    if lock.taken_over:
        log.warning(f"warning: took over {lock.path}, left by a run that no longer exists: {lock.taken_over}")
    refused = distributed.all_reduce_sum([1.0 if problem else 0.0], env)[0]
    if problem:
        raise ConfigError(problem)
    if refused:
        raise ConfigError("rank 0 refused --output-dir; its message is in workerlog.0")


def _log_start(log: logging.Logger, cfg: Config, env: DistEnv, ds: data.Dataset, splits: tuple, threads: int):
    train, val, test = splits
    log.info(
        f"rank {env.rank} of world size {env.world_size} (local rank {env.local_rank} of {env.local_size}), "
        f"backend {env.backend}, device {env.device}"
    )
    per_worker = cfg.batch_size // env.world_size
    micro = f" ({cfg.accum_steps} micro-batches of {per_worker // cfg.accum_steps})" if cfg.accum_steps > 1 else ""
    lr = effective_lr(cfg)
    scaled = (
        f" = {cfg.lr} x {cfg.batch_size}/{cfg.reference_batch} (linear scaling)" if cfg.lr_scaling == "linear" else ""
    )
    warmup = f", warmup {cfg.warmup_epochs:g} epochs" if cfg.warmup_epochs else ""
    log.info(
        f"batch: {per_worker} per worker{micro}, {cfg.batch_size} global; "
        f"lr {lr:g}{scaled} ({cfg.lr_schedule}{warmup}), momentum {cfg.momentum}, weight decay {cfg.weight_decay}, "
        f"epochs {cfg.epochs}"
        + (f", label smoothing {cfg.label_smoothing:g}" if cfg.label_smoothing else "")
        + (f", amp {cfg.amp}" if cfg.amp != "off" else "")
    )
    c, h, w = ds.image_shape
    split_text = (
        f"validation/test {len(val)} of {len(ds.test)} (the test split serves as validation)"
        if ds.val_is_test
        else f"validation {len(val)} of {len(ds.val)}, test {len(test)} of {len(ds.test)}"
    )
    shape = f"{c}x{h}x{w}, {len(ds.classes)} classes"
    log.info(f"dataset {ds.name} ({shape}): train {len(train)} of {len(ds.train)}, {split_text}")
    mean = ", ".join(f"{m:.4f}" for m in ds.mean)
    std = ", ".join(f"{x:.4f}" for x in ds.std)
    log.info(f"input: normalised with training mean ({mean}) and std ({std}); augmentation {_augment_text(cfg, ds)}")
    mkl = os.environ.get(cpu.MKL_CODE_PATH)
    avx2 = " (MKL's AVX2 kernels)" if mkl == cpu.AVX2_CODE_PATH else ""
    log.info(
        f"paddle {paddle.__version__}, CPU threads {threads} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})"
        + (f", {cpu.MKL_CODE_PATH}={mkl}{avx2}" if mkl else "")
    )


def _augment_text(cfg: Config, ds: data.Dataset) -> str:
    if not cfg.augment:
        return "off"
    return augment.describe(augment.policy_for(ds.name, cfg.shift))


def _checkpoint_state(
    model, opt, sched, scaler, ema, cfg: Config, epoch: int, batch_in_epoch: int, step: int, elapsed_s: float
) -> dict:
    """epoch counts whole epochs done; batch_in_epoch the batches of the next one already trained; elapsed_s the
    training time up to here, summed over the sessions of a resumed run. Mid-epoch, the caller adds every rank's
    batch norm statistics (untrained_by_rank)."""
    return {
        "model": distributed.unwrap(model).state_dict(),
        "ema": ema.state_dict() if ema else None,
        "optimizer": opt.state_dict(),
        "lr_scheduler": sched.state_dict(),
        "epoch": epoch,
        "batch_in_epoch": batch_in_epoch,
        "step": step,
        "rng": {"paddle": paddle.get_rng_state(), "numpy": np.random.get_state()},
        "config": dataclasses.asdict(cfg),
        "scaler": scaler.state_dict() if scaler else None,  # fp16 loss scale, so a resumed run keeps it
        "elapsed_s": elapsed_s,
    }


def _choose_checkpoint(cfg: Config, env: DistEnv, log: logging.Logger) -> Path | None:
    """The newest intact checkpoint, chosen by rank 0 for every rank; damaged ones are set aside with a warning.

    Intact: its SHA-256 matches and the restricted loader reads it. When checkpoints exist but none is intact,
    the run stops before anything is overwritten.
    """
    chosen, tried = None, []
    if env.is_main and cfg.resume != "no":
        for path in reversed(checkpoint.list_checkpoints(cfg.output_dir)):
            try:
                checkpoint.load(path)
            except checkpoint.CheckpointError as e:
                aside = checkpoint.set_aside(path)
                log.warning(f"warning: {e}; set aside as {aside.name}, trying the next older checkpoint")
                tried.append(f"{path.name} ({aside.name})")
                continue
            chosen = path
            break
    step, failed = distributed.all_reduce_max_values(
        [checkpoint.step_of(chosen) if chosen else -1, 1.0 if tried and not chosen else 0.0], env
    )
    if failed:
        folder = Path(cfg.output_dir) / checkpoint.CKPT_DIR
        what = f"tried, and set aside: {', '.join(tried)}" if env.is_main else "rank 0's log names what it tried"
        raise ConfigError(
            f"--resume: no intact checkpoint in {folder} ({what}); nothing was overwritten: restore a checkpoint, "
            "or start afresh with --overwrite and without --resume"
        )
    return checkpoint.checkpoint_path(cfg.output_dir, int(step)) if step >= 0 else None


def _restore(path, model, opt, sched, scaler, ema, cfg: Config, untrained: dict) -> tuple[int, int, int, float]:
    state = checkpoint.load(path)
    saved = state.get("config", {})
    for key in ("model", "dataset", "batch_size"):
        if saved.get(key) != getattr(cfg, key):
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                f"--resume: {path} was trained with {flag} {saved.get(key)}, not {getattr(cfg, key)}; "
                f"pass {flag} {saved.get(key)} or another --output-dir"
            )
    model.set_state_dict(state["model"])
    # set after DataParallel has broadcast rank 0's
    untrained.update(model=state.get("untrained_by_rank") or [], ema=state.get("ema_untrained_by_rank") or [])
    opt.set_state_dict(state["optimizer"])
    sched.set_state_dict(state["lr_scheduler"])
    if scaler and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if ema:  # a checkpoint from before --ema was turned on starts the average from its weights
        ema.set_state_dict(state.get("ema") or state["model"])
    paddle.set_rng_state(state["rng"]["paddle"])
    np.random.set_state(state["rng"]["numpy"])
    elapsed = float(state.get("elapsed_s", 0.0))  # older checkpoints lack it
    return int(state["epoch"]), int(state["batch_in_epoch"]), int(state["step"]), elapsed


def _weights_finite(model) -> bool:
    return all(bool(paddle.isfinite(p).all()) for p in model.parameters())


def _check_weights(model, epoch: int, step: int) -> None:
    """Identical weights on every rank, so every rank stops here together."""
    if not _weights_finite(model):
        raise engine.Diverged(
            f"the weights became NaN or infinite in epoch {epoch + 1} (by step {step}); lower --lr, and restart "
            "or --resume from the last checkpoint (it was saved before this)"
        )


def _epoch_row(cfg: Config, env: DistEnv, epoch: int, step: int, stats, val, lr: float) -> dict:
    return {
        "epoch": epoch + 1,
        "step": step,
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
        "lr": lr,
        "rss_mb": memory_mb()[0],
        "time_s": timing.since_command_start(),  # seconds since the command (the launcher, if any) started
    }


def _log_epoch(log: logging.Logger, cfg: Config, row: dict, stats: engine.EpochStats) -> None:
    step_ms = 1000 * stats.own_seconds / max(stats.steps, 1)
    log.info(f"epoch {row['epoch']} time per {timing.describe(stats.phase_shares, step_ms, stats.samples)}")
    log.info(
        f"epoch {row['epoch']}/{cfg.epochs} done: train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f} | "
        f"val loss {row['val_loss']:.4f} acc {row['val_acc']:.4f} ({row['val_count']} images) | "
        f"{row['epoch_time_s']:.1f}s, {row['images_per_sec']:.0f} img/s global, "
        f"input wait {100 * row['input_wait_share']:.1f}%, memory {row['rss_mb']:.0f} MiB"
    )


def _stopped(signum: int, step: int, where: str, saved: Path | None) -> Preempted:
    kept = f"checkpoint {saved}" if saved else "nothing trained yet, so no checkpoint"
    return Preempted(
        signum,
        f"stopped by {preempt.signal_name(signum)} at step {step} ({where}); {kept}; "
        f"continue with: {preempt.resume_command()}",
    )


def run(
    cfg: Config, env: DistEnv, log: logging.Logger, stop: StopSignals | None = None, lock: RunLock | None = None
) -> dict:
    stop = stop or StopSignals()  # not installed: no signal is ever recorded
    lock = lock or RunLock(cfg.output_dir)
    if cfg.amp == "fp16" and env.device == "cpu":
        raise ConfigError(
            "--amp fp16 needs a GPU: Paddle's CPU kernels compute in float32 or bfloat16; "
            "use --amp bf16 or --amp off on CPU"
        )
    if cfg.sync_bn and (problem := distributed.sync_bn_problem(env)):
        raise ConfigError(problem)
    threads = distributed.cpu_threads(cfg.cpu_threads, env.local_size)
    if env.device == "cpu":
        distributed.apply_cpu_threads(threads)
    ds = data.load_dataset(cfg.dataset, cfg.data_dir)
    train, val_split, test = ds.train.head(cfg.train_limit), ds.val.head(cfg.eval_limit), ds.test.head(cfg.eval_limit)
    if len(train) < cfg.batch_size:
        raise ConfigError(
            f"the training split has {len(train)} images, fewer than one global batch of {cfg.batch_size}; "
            "lower --batch-size or raise --train-limit"
        )
    _log_start(log, cfg, env, ds, (train, val_split, test), threads)
    _agree_output_dir(cfg, env, lock, log)

    paddle.seed(cfg.seed)  # the same seed on every rank: the same initial weights everywhere
    np.random.seed(cfg.seed)
    model = build_model(cfg.model, len(ds.classes), ds.image_shape)
    log.info(f"model {cfg.model}: {count_parameters(model):,} parameters")
    if cfg.sync_bn:
        model = distributed.convert_sync_bn(model, env)
    sampler = engine.make_sampler(len(train), cfg, env)
    steps_per_epoch = len(sampler)
    # the schedule is planned over --epochs; --max-steps only stops early, so a stopped run can be resumed exactly
    planned = cfg.epochs * steps_per_epoch
    last_step = min(planned, cfg.max_steps) if cfg.max_steps else planned
    opt, sched = engine.make_optimizer(cfg, model, planned, round(cfg.warmup_epochs * steps_per_epoch))
    scaler = engine.make_scaler(cfg)
    ema = WeightAverage(model, build_model(cfg.model, len(ds.classes), ds.image_shape), cfg.ema) if cfg.ema else None

    start_epoch = skip = step = 0
    trained_before = 0.0  # seconds of training in earlier sessions of this run
    untrained: dict[str, list] = {}  # every rank's batch norm statistics, from a stop's checkpoint
    resumed = _choose_checkpoint(cfg, env, log)
    if resumed:
        start_epoch, skip, step, trained_before = _restore(resumed, model, opt, sched, scaler, ema, cfg, untrained)
        log.info(f"resumed from {resumed}: epoch {start_epoch + 1}, batch {skip}, step {step}")
    files = RunFiles(cfg, env)
    files.start(start_epoch if resumed else None, step, log)
    model = distributed.wrap(model, env)
    distributed.set_untrained(model, untrained.get("model", []), env)
    if ema:
        distributed.set_untrained(ema.net, untrained.get("ema", []), env)

    cadence = preempt.Cadence()

    def meet(at_step: int) -> int:
        """Where every rank meets: all stop if rank 0's last write failed; else the agreed stop signal (0: none).
        One all-reduce of three numbers, so a signal that reached only some ranks stops all at the same step."""
        shared = [stop.signum, files.failure is not None, cadence.seconds_per_step(at_step)]
        signum, failed, per_step = distributed.all_reduce_max_values(shared, env)
        if failed:
            raise WriteFailed(files.failure_message())
        cadence.plan(at_step, per_step)
        return int(signum)

    if signum := meet(step):  # a signal during start-up: data, model, checkpoint loading
        raise _stopped(signum, step, "before training", resumed)

    started = time.time() - trained_before  # wall_time_s in results.json covers every session of the run

    def state_now(epoch: int, batch_in_epoch: int, step: int) -> dict:
        elapsed = time.time() - started
        return _checkpoint_state(model, opt, sched, scaler, ema, cfg, epoch, batch_in_epoch, step, elapsed)

    def average_statistics() -> None:
        """Every rank takes part, so every rank then holds the statistics rank 0 saves and evaluates with."""
        distributed.average_running_statistics(model, env)
        if ema:
            distributed.average_running_statistics(ema.net, env)

    scored = ema.net if ema else model  # what is evaluated, saved as model.pdparams and exported

    val = None
    dog = Watchdog(env, cfg.collective_timeout, log)
    with dog:
        for epoch in range(start_epoch, cfg.epochs):
            if step >= last_step:
                break
            sampler.set_epoch(data.sampler_epoch(cfg.seed, epoch))

            def save_mid_epoch(batch: int, at_step: int, loss_sum: paddle.Tensor, for_stop: bool, epoch: int = epoch):
                if for_stop:
                    # a save an uninterrupted run does not make: keep each rank's batch norm statistics as they
                    # are (averaging them would change the final ones in the last bits), for the resumed run
                    extra = {"untrained_by_rank": distributed.gather_untrained(model, env)}
                    if ema:
                        extra["ema_untrained_by_rank"] = distributed.gather_untrained(ema.net, env)
                else:
                    # every rank takes part, so a resumed run restarts from the statistics it had, on every rank
                    average_statistics()
                    extra = {}
                # never let diverged weights push a good checkpoint out; the next loss check stops every rank
                if files.enabled and np.isfinite(float(loss_sum)) and _weights_finite(model):
                    files.save_checkpoint({**state_now(epoch, batch, at_step), **extra})

            def after_step(batch: int, at_step: int, loss_sum: paddle.Tensor, epoch: int = epoch) -> None:
                dog.progress(at_step)
                if ema:
                    ema.update(at_step)
                every = cfg.save_every_steps
                saved = every and at_step % every == 0 and batch < steps_per_epoch
                if saved:
                    save_mid_epoch(batch, at_step, loss_sum, for_stop=False)
                # the step that ends the epoch or the run is followed by the epoch end, which meets anyway
                meeting = batch < steps_per_epoch and at_step < last_step and cadence.due(at_step)
                if meeting and (signum := meet(at_step)):
                    if not saved:
                        save_mid_epoch(batch, at_step, loss_sum, for_stop=True)
                        meet(at_step)  # a failed save stops every rank with the write error
                    where = f"epoch {epoch + 1}, batch {batch} of {steps_per_epoch}"
                    raise _stopped(signum, at_step, where, checkpoint.checkpoint_path(cfg.output_dir, at_step))

            plan = engine.EpochPlan(epoch, skip, step, last_step)
            stats = engine.train_one_epoch(
                model, opt, sched, train, sampler, ds, cfg, env, log, plan, after_step, scaler=scaler
            )
            step += stats.steps
            done = skip + stats.steps
            skip = 0
            average_statistics()
            val = engine.evaluate(scored, val_split, ds, cfg, env)
            dog.progress(step)
            row = _epoch_row(cfg, env, epoch, step, stats, val, opt.get_lr())
            _log_epoch(log, cfg, row, stats)
            _check_weights(model, epoch, step)
            files.append_metrics(row)
            if files.enabled:  # only rank 0 writes: the others need not gather the state
                whole = done == steps_per_epoch
                files.save_checkpoint(state_now(epoch + whole, 0 if whole else done, step))
            if signum := meet(step):  # a signal during evaluation or the checkpoint write stops here
                raise _stopped(
                    signum, step, f"end of epoch {epoch + 1}", checkpoint.checkpoint_path(cfg.output_dir, step)
                )
            if cfg.target_acc and val.acc >= cfg.target_acc:  # the same figure on every rank: all stop here
                log.info(f"reached --target-acc {cfg.target_acc:g}: accuracy {val.acc:.4f} after epoch {epoch + 1}")
                break

    net = distributed.unwrap(scored)
    files.save_weights(net)
    if val is not None and ds.val_is_test:
        final = val  # the last epoch's evaluation: same weights, same images
    else:
        final = engine.evaluate(net, test, ds, cfg, env)
    peak_mb = memory_mb()[1]  # rank 0's in results.json; each rank's in its log
    result = {
        "test_loss": final.loss,
        "test_acc": final.acc,
        "test_count": final.count,
        "steps": step,
        "world_size": env.world_size,
        "global_batch_size": cfg.batch_size,
        "wall_time_s": time.time() - started,
        "peak_rss_mb": peak_mb,
    }
    files.write_json("results.json", result)
    meet(step)  # training is over: a signal from here on lets the run finish; a failed write still stops it
    log.info(f"parameters sha256 {checkpoint.digest(net)}")
    log.info(
        f"finished: test accuracy {final.acc:.4f} on {final.count} images, loss {final.loss:.4f}; "
        f"peak memory {peak_mb:.0f} MiB; "
        f"weights in {os.path.join(cfg.output_dir, 'model.pdparams')}"
    )
    files.finish()
    failed = _export(files, net, ds, cfg)  # last: if paddle.jit.save fails, the weights and results are written
    if distributed.all_reduce_max_values([failed is not None], env)[0]:
        raise failed or ExportFailed("rank 0 could not export the inference model; its message is in workerlog.0")
    distributed.barrier(env)
    return result


class ExportFailed(RuntimeError):
    """paddle.jit.save failed after training; the weights and results were written before it."""


def _export(files: RunFiles, net: paddle.nn.Layer, ds: data.Dataset, cfg: Config) -> ExportFailed | None:
    """None, or the error to raise on every rank once they all know (rank 0 exports alone)."""
    try:
        files.export_inference(net, ds)
    except Exception as e:
        out = cfg.output_dir
        failed = ExportFailed(
            f"exporting the inference model to {os.path.join(out, 'inference')} failed ({type(e).__name__}: {e}); "
            f"nothing else is lost: the weights are in {os.path.join(out, 'model.pdparams')} and the results in "
            f"{os.path.join(out, 'results.json')}. Fix the cause, then run the same command with --resume yes: "
            "it loads the finished run's last checkpoint and exports again without training"
        )
        failed.__cause__ = e
        return failed
    return None


def _point_to_summary(log: logging.Logger) -> None:
    log_dir = os.environ.get("PADDLE_LOG_DIR")  # set by paddle.distributed.launch
    if log_dir:
        log.info(f"every worker's status and the first failure: python -m paddle_mnist.logs {log_dir}")


def main(argv: list[str] | None = None) -> int:
    cpu.prefer_fast_kernels()  # first: MKL reads its settings at the first matmul or convolution
    stop = StopSignals().install()  # then take SIGTERM/SIGINT over: Paddle's import installed handlers that abort
    try:
        cfg = parse_args(argv)
        env = distributed.setup()
    except (ConfigError, LaunchError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    log = get_logger(env)
    stop.log = log
    lock = RunLock(cfg.output_dir)
    stop.on_abort.append(lock.release)
    try:
        run(resolve_for_world(cfg, env.world_size), env, log, stop, lock)
    except Preempted as e:
        log.warning(str(e))
        return preempt.exit_code(e.signum)
    except WriteFailed as e:
        log.error(f"error: {e}")
        _point_to_summary(log)
        return 1
    except (ConfigError, data.DataError, engine.Diverged, checkpoint.CheckpointError) as e:
        log.error(f"error: {e}")
        _point_to_summary(log)
        return 2
    except ExportFailed as e:
        log.error(f"error: {e}", exc_info=e.__cause__)
        _point_to_summary(log)
        return 1
    except Exception:
        log.exception("error: the run failed")
        _point_to_summary(log)
        return 1
    finally:
        lock.release()
    return 0
