"""The command line: parse, set up the workers, train, evaluate, save."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

import numpy as np
import paddle

from . import augment, checkpoint, cpu, data, distributed, engine, timing
from .config import Config, ConfigError, effective_lr, parse_args, resolve_for_world
from .distributed import DistEnv, LaunchError
from .ema import WeightAverage
from .log import get_logger, memory_mb
from .models import build_model, count_parameters
from .outputs import RunFiles, output_dir_problem
from .watchdog import Watchdog


def _agree_output_dir(cfg: Config, env: DistEnv) -> None:
    """Rank 0 judges --output-dir; every rank learns the verdict, so no worker waits on one that quit."""
    problem = output_dir_problem(cfg) if env.is_main else None
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
    training time up to here, summed over the sessions of a resumed run."""
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


def _restore(path, model, opt, sched, scaler, ema, cfg: Config) -> tuple[int, int, int, float]:
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


def run(cfg: Config, env: DistEnv, log: logging.Logger) -> dict:
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
    _agree_output_dir(cfg, env)

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
    ckpts = checkpoint.list_checkpoints(cfg.output_dir) if cfg.resume != "no" else []
    if ckpts:
        start_epoch, skip, step, trained_before = _restore(ckpts[-1], model, opt, sched, scaler, ema, cfg)
        log.info(f"resumed from {ckpts[-1]}: epoch {start_epoch + 1}, batch {skip}, step {step}")
    files = RunFiles(cfg, env)
    files.start(start_epoch if ckpts else None)
    model = distributed.wrap(model, env)

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

            def after_step(batch: int, at_step: int, loss_sum: paddle.Tensor, epoch: int = epoch) -> None:
                dog.progress(at_step)
                if ema:
                    ema.update(at_step)
                every = cfg.save_every_steps
                if every and at_step % every == 0 and batch < steps_per_epoch:
                    # a resumed run restarts from the statistics it had, on every rank
                    average_statistics()
                    # never let diverged weights push a good checkpoint out; the next loss check stops every rank
                    if files.enabled and np.isfinite(float(loss_sum)) and _weights_finite(model):
                        files.save_checkpoint(state_now(epoch, batch, at_step))

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
    log.info(f"parameters sha256 {checkpoint.digest(net)}")
    log.info(
        f"finished: test accuracy {final.acc:.4f} on {final.count} images, loss {final.loss:.4f}; "
        f"peak memory {peak_mb:.0f} MiB; "
        f"weights in {os.path.join(cfg.output_dir, 'model.pdparams')}"
    )
    files.finish()
    _export(files, net, ds, cfg)  # last: if paddle.jit.save fails, the weights and results are already written
    distributed.barrier(env)
    return result


class ExportFailed(RuntimeError):
    """paddle.jit.save failed after training; the weights and results were written before it."""


def _export(files: RunFiles, net: paddle.nn.Layer, ds: data.Dataset, cfg: Config) -> None:
    try:
        files.export_inference(net, ds)
    except Exception as e:
        out = cfg.output_dir
        raise ExportFailed(
            f"exporting the inference model to {os.path.join(out, 'inference')} failed ({type(e).__name__}: {e}); "
            f"nothing else is lost: the weights are in {os.path.join(out, 'model.pdparams')} and the results in "
            f"{os.path.join(out, 'results.json')}. Fix the cause, then run the same command with --resume yes: "
            "it loads the finished run's last checkpoint and exports again without training"
        ) from e


def _point_to_summary(log: logging.Logger) -> None:
    log_dir = os.environ.get("PADDLE_LOG_DIR")  # set by paddle.distributed.launch
    if log_dir:
        log.info(f"every worker's status and the first failure: python -m paddle_mnist.logs {log_dir}")


def main(argv: list[str] | None = None) -> int:
    cpu.prefer_fast_kernels()  # first: MKL reads its settings at the first matmul or convolution
    try:
        cfg = parse_args(argv)
        env = distributed.setup()
    except (ConfigError, LaunchError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    log = get_logger(env)
    try:
        run(resolve_for_world(cfg, env.world_size), env, log)
    except (ConfigError, data.DataError, engine.Diverged) as e:
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
    return 0
