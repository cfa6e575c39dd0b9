"""The trainer: train_and_evaluate runs one job on one worker (data, model, resume, epochs, the test score, the
final weights, results and export), with the agreements every rank must reach before it goes on.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import paddle

from paddle_mnist.config import (
    FOLDER,
    RECIPES,
    Config,
    ConfigError,
    DataFacts,
    effective_lr,
    global_batch,
    resolve,
    starts_from_weights,
    tta_each_epoch,
)
from paddle_mnist.datasets import augment, data, folder, labels
from paddle_mnist.datasets.datafiles import REPO_DATA
from paddle_mnist.datasets.transfer import Feed
from paddle_mnist.files import checkpoint, options, report
from paddle_mnist.files.log import memory_mb
from paddle_mnist.network import batchnorm, summary, whiten
from paddle_mnist.network.models import build_model, count_parameters
from paddle_mnist.ops import onednn
from paddle_mnist.runtime import cpu, distributed, launch, waiting
from paddle_mnist.runtime.distributed import DistEnv
from paddle_mnist.runtime.lock import RunLock
from paddle_mnist.runtime.preempt import Preempted, StopSignals, signal_name
from paddle_mnist.training import agreement, chance, engine, evaluation, finetune, scores
from paddle_mnist.training.checkpoints import Checkpoints
from paddle_mnist.training.outputs import BEST_WEIGHTS, MODEL_SUMMARY, RESULTS, WEIGHTS, RunFiles, output_dir_problem
from paddle_mnist.training.session import Session
from paddle_mnist.training.state import TrainState


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
    _check_shared(cfg, env, log)


SHARED_WAIT_S = 10.0  # how long a rank looks for rank 0's marker: a network file system may show a new file late


def _check_shared(cfg: Config, env: DistEnv, log: logging.Logger) -> None:
    """Whether every rank sees the file rank 0 just wrote into --output-dir: rank 0 writes the checkpoints and every
    rank reads them on --resume, so an output directory on each machine's own disk failed only at the resume, with
    a traceback. Where some rank does not, every rank says so in one line: an error with --resume (it cannot work),
    a warning without (training works; a resume would not)."""
    if env.world_size == 1:
        return
    host = socket.gethostname()
    marker = Path(cfg.output_dir) / f".paddle_mnist-shared-{host}-{os.getpid()}-{time.time_ns()}"
    if env.is_main:
        marker.write_text("")
    name = distributed.gather_objects(marker.name, env)[0]
    ours, deadline = Path(cfg.output_dir) / name, time.monotonic() + SHARED_WAIT_S
    while not ours.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    seen = distributed.gather_objects((ours.exists(), host), env)
    if env.is_main:
        marker.unlink(missing_ok=True)
    blind = [f"rank {r} on {where}" for r, (sees, where) in enumerate(seen) if not sees]
    if not blind:
        return
    more = f" (and {len(blind) - 3} more)" if len(blind) > 3 else ""
    problem = (
        f"--output-dir is not shared: {', '.join(blind[:3])}{more} cannot see the file rank 0 ({seen[0][1]}) wrote "
        f"into {cfg.output_dir} {SHARED_WAIT_S:.0f} s before; rank 0 writes the checkpoints and every rank reads "
        "them to resume"
    )
    fix = "put --output-dir on storage every machine mounts"
    if cfg.resume != "no":
        raise ConfigError(f"{problem}, so --resume cannot work: {fix}")
    log.warning(f"warning: {problem}, so a --resume of this run would fail: {fix}")


def _log_start(
    cfg: Config, env: DistEnv, log: logging.Logger, ds: data.Dataset, splits: tuple, threads: int, steps_per_epoch: int
) -> None:
    train, val, test = splits
    per_worker = cfg.batch_size // env.world_size
    micro = f" ({cfg.accum_steps} micro-batches of {per_worker // cfg.accum_steps})" if cfg.accum_steps > 1 else ""
    lr = effective_lr(cfg)
    scaled = (
        f" = {cfg.lr} x {cfg.batch_size}/{cfg.reference_batch} (linear scaling)" if cfg.lr_scaling == "linear" else ""
    )
    warmup = f", warmup {cfg.warmup_epochs:g} epochs" if cfg.warmup_epochs else ""
    nesterov = " (Nesterov)" if cfg.nesterov else ""
    optimizer = (
        f"AdamW, weight decay {cfg.weight_decay} (none on biases and batch norm)"
        if cfg.optimizer == "adamw"
        else f"momentum {cfg.momentum}{nesterov}, weight decay {cfg.weight_decay}"
    )
    log.info(
        f"batch: {per_worker} per worker{micro}, {cfg.batch_size} global; "
        f"lr {lr:g}{scaled} ({cfg.lr_schedule}{warmup}), {optimizer}, "
        f"epochs {cfg.epochs}{_stretched_text(cfg, len(train), steps_per_epoch)}"
        + (f", label smoothing {cfg.label_smoothing:g}" if cfg.label_smoothing else "")
        + (", class weights balanced" if cfg.class_weights == "balanced" else "")
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
    if env.world_size == 1 and not env.device.startswith("gpu") and threads > 2:
        log.info(cpu.workers_advice(threads))


def _stretched_text(cfg: Config, train_images: int, steps_per_epoch: int) -> str:
    recipe = RECIPES[cfg.model].epochs
    if "epochs" not in cfg.from_recipe or cfg.epochs == recipe:
        return ""
    return (
        f" (the recipe's {recipe} stretched to at least --min-steps {cfg.min_steps} optimizer steps: "
        f"{train_images} training images make {steps_per_epoch} steps an epoch)"
    )


def _augment_text(cfg: Config, ds: data.Dataset) -> str:
    if not cfg.augment:
        return "off"
    return augment.describe(ds.name, ds.image_shape, cfg.shift, cfg.flip, ds.mirror_asymmetry, **data.photo_ops(cfg))


def _log_model(cfg: Config, env: DistEnv, log: logging.Logger, ds: data.Dataset, model: paddle.nn.Layer) -> str | None:
    """Rank 0 logs the model's headline once per run and returns paddle.summary's table of layers and output shapes,
    which goes to MODEL_SUMMARY in the output directory, not into the log; the other ranks log the parameters."""
    if not env.is_main:
        log.info(f"model {cfg.model}: {count_parameters(model):,} parameters")
        return None
    described = summary.describe(cfg.model, len(ds.classes), ds.image_shape)
    log.info(f"{described.headline(cfg.model)}; its layers: {Path(cfg.output_dir) / MODEL_SUMMARY}")
    return described.table


def _exactness(cfg: Config, env: DistEnv, state: TrainState) -> list[str]:
    """The start-up lines that say how batch norm normalises and whether N workers train one process's weights."""
    lines = []
    if batchnorm.spans_global_batch(state.model):
        per = f"{cfg.batch_size // cfg.accum_steps} images" + (" (a micro-batch)" if cfg.accum_steps > 1 else "")
        lines.append(f"batch norm: statistics over the global batch of {per}, on every worker (--sync-bn)")
    elif cfg.sync_bn:
        lines.append("batch norm: SyncBatchNorm over the global batch (--sync-bn)")
    elif batchnorm.norm_layers(state.model) and env.device == "cpu" and env.world_size > 1:
        lines.append(
            f"batch norm: statistics of each worker's {cfg.batch_size // env.world_size // cfg.accum_steps} images; "
            "--sync-bn normalises over the global batch, and then any number of workers trains one process's weights"
        )
    if state.exact:
        lines.append(
            "gradients: each step's summed in float64 and rounded once (network/exact.py): any number of workers "
            "or --accum-steps trains the weights of one process, to the bit"
            + (" (with batch norm: at the same --accum-steps)" if batchnorm.norm_layers(state.model) else "")
        )
    return lines


def _check_start(cfg: Config, env: DistEnv) -> int:
    """Refuse what this device cannot run; set the CPU threads. The threads per worker."""
    if problem := launch.amp_problem(cfg.amp, env.device, launch.device_capability(env.device)):
        raise ConfigError(problem)
    threads = cpu.threads_per_worker(cfg.cpu_threads, env.local_size)
    if env.device == "cpu":
        paddle.base.core.set_num_threads(threads)
        cpu.set_openmp_threads(threads)  # oneDNN's OpenMP runtime too, which Paddle's setting does not reach
    return threads


def _load_data(cfg: Config, env: DistEnv, log: logging.Logger, stop: StopSignals) -> tuple[data.Dataset, DataFacts]:
    """The dataset, and its facts the configuration is resolved with (the class names, the training images, and for
    a folder the image size and channels it uses).

    A folder (or --labels' files) is listed and checked by every rank; its cache is built by the first worker of
    each machine while the others wait in the job's key-value store (waiting.Meeting), however long the decoding
    takes, and every rank learns whether that worked before any of them goes on.
    """
    if cfg.dataset != FOLDER:
        ds = data.load_dataset(cfg.dataset, cfg.data_dir)
        return ds, DataFacts(ds.classes, len(ds.train))
    listing, caches = labels.source(cfg)
    request = folder.Request.of(cfg)
    problem = None
    stopped = lambda: stop.signum  # noqa: E731
    with waiting.Meeting("folder-cache", "the folder's cache", env, log, stopped, unit="images") as meeting:
        if env.local_rank == 0:
            try:
                folder.ensure_cache(listing, request, caches, log, report=meeting.report, stopped=stopped)
            except data.DataError as e:
                problem = e
            except folder.BuildStopped as e:
                raise Preempted(
                    e.signum,
                    f"stopped by {signal_name(e.signum)} while decoding the folder; the unfinished cache was removed "
                    "and nothing was trained: run the same command again",
                ) from None
        refused = meeting.finish(problem is None)
    if problem:
        raise problem
    if refused:
        raise data.DataError("the folder was refused by the worker that decodes it; its message is in its log")
    cache = folder.find(listing, request, caches)
    ds, manifest = folder.load(listing, request, cache)
    width, height = manifest["size"]
    if listing.ignored:
        log.info(f"left out {len(listing.ignored)} files that are not images by their name, e.g. {listing.ignored[0]}")
    if bad_rows := labels.left_out(listing):
        log.warning(bad_rows)
    if manifest["skipped"]:
        log.warning(f"warning: left out {len(manifest['skipped'])} unreadable images: {'; '.join(manifest['skipped'])}")
    numbered = folder.numbered(ds.classes)  # labels follow the sorted folder names: say which is which
    order = "labels by sorted label" if cfg.labels else "labels by sorted folder name"
    log.info(f"classes ({len(ds.classes)}, {order}): {numbered}; images from the cache {cache}")
    return ds, DataFacts(ds.classes, len(ds.train), f"{width}x{height}", manifest["channels"])


def _check_memory(cfg: Config, env: DistEnv, ds: data.Dataset) -> None:
    """Refuse, on every rank alike, a model and batch whose training would not fit the memory of a worker's machine
    (shared by its workers), before the model is built: the kernel would otherwise kill a worker without a line."""
    micro = cfg.batch_size // (env.world_size * cfg.accum_steps)
    need = summary.training_bytes(cfg.model, len(ds.classes), ds.image_shape, micro)
    available = summary.available_bytes()
    short = available is not None and need * env.local_size > available
    if not distributed.all_reduce_max_values([short], env)[0]:
        return
    if not short:
        raise ConfigError("another worker's machine has too little memory for this model and batch: see its log")
    channels, height, width = ds.image_shape
    workers = f" for each of its {env.local_size} workers" if env.local_size > 1 else ""
    raise ConfigError(
        f"--model {cfg.model} on {width}x{height} images, {micro} a step per worker, needs about "
        f"{need / 2**30:.1f} GiB of memory{workers}; this machine has {available / 2**30:.1f} GiB available: pass a "
        f"smaller --image-size or --batch-size (or --accum-steps), or start fewer workers"
    )


def _splits(cfg: Config, ds: data.Dataset, parts: int) -> tuple[data.Split, data.Split, data.Split]:
    """The splits the run uses; parts: the micro-batches a global batch splits into (workers x --accum-steps)."""
    train, val, test = ds.train.head(cfg.train_limit), ds.val.head(cfg.eval_limit), ds.test.head(cfg.eval_limit)
    if len(train) < cfg.batch_size:
        fits = len(train) - len(train) % parts
        multiple = f" (a multiple of {parts})" if parts > 1 else ""
        fix = f"pass --batch-size {fits} or less{multiple}" if fits else "add training images"
        if 0 < cfg.train_limit < len(ds.train):
            fix += " or raise --train-limit"
        raise ConfigError(
            f"the training split has {len(train)} images, fewer than one global batch of {cfg.batch_size}: {fix}"
        )
    return train, val, test


def _weights_loader(cfg: Config, env: DistEnv, log: logging.Logger, stop: StopSignals, resumed: Path | None):
    """finetune.weights_loader's loader for TrainState.create with --init-from or --pretrained; None without, and on a
    resume, which continues the checkpoint (its weights, and its record of the loaded layers) instead."""
    if not starts_from_weights(cfg):
        return None
    if resumed:
        flag = f"--init-from {cfg.init_from}" if cfg.init_from else f"--pretrained {cfg.pretrained}"
        log.info(f"{flag} is not read: the run continues from its checkpoint {resumed} (a resume wins)")
        return None
    return finetune.weights_loader(cfg, env, log, lambda: stop.signum)


def train_and_evaluate(
    flags: Config,
    env: DistEnv,
    log: logging.Logger,
    lock: RunLock,
    stop: StopSignals | None = None,
    convolutions: onednn.Prepared | None = None,
    hooks: Sequence[Callable[[int, dict], object]] = (),
    command: str | None = None,
) -> dict:
    """The job on this worker: data, model, resume, train epoch by epoch, then the final weights, the test score,
    results.json and the export; its results. flags: the command line's configuration, which the run resolves once,
    with the world size and the data's facts (config.resolve), before anything is trained or written. lock: the
    run's lock on --output-dir, the caller's to release (rank 0 takes it here, once the output directory is judged);
    stop: the installed signal handlers (none: a signal is never recorded); convolutions: oneDNN's operator as
    prepared before the process group (none: prepared here); hooks: train()'s on_epoch_end callbacks (Session);
    command: what started the run, for args.yaml's header (None: this process's command line)."""
    stop = stop or StopSignals()  # not installed: no signal is ever recorded
    batch = global_batch(flags, env.world_size)  # a batch the workers cannot split is refused before the data is read
    threads = _check_start(flags, env)
    log.info(  # before the data: a folder's first cache build can take minutes
        f"rank {env.rank} of world size {env.world_size} (local rank {env.local_rank} of {env.local_size}), "
        f"backend {env.backend}, device {env.device}"
    )
    try:
        log.info(onednn.activate(convolutions or onednn.prepare(flags.conv_backend), env.device))
    except onednn.Unavailable as e:
        raise ConfigError(f"--conv-backend onednn: {e}; or pass --conv-backend auto") from None
    # before the first collective whose shape follows the flags: ranks that differ stop here, naming the difference
    job = agreement.job_facts(flags, "oneDNN" if onednn.active() else "Paddle's")
    agreement.agree({**job, "--batch-size": batch}, env)  # the global batch: a default and its value given agree
    ds, facts = _load_data(flags, env, log, stop)
    cfg = resolve(flags, env.world_size, facts)
    if env.world_size > 1:
        agreement.agree(agreement.data_facts(cfg, ds.train.images, ds.train.labels), env)
    train, val_split, test = _splits(cfg, ds, env.world_size * cfg.accum_steps)
    _check_memory(cfg, env, ds)
    batches = data.TrainBatches(train, ds, cfg.batch_size // env.world_size, env.rank, env.world_size, cfg)
    _log_start(cfg, env, log, ds, (train, val_split, test), threads, len(batches))
    _agree_output_dir(cfg, env, lock, log)

    def whitening(model) -> None:
        try:
            log.info(whiten.whiten(model, train.images, ds.mean, ds.std))
        except ValueError as e:
            raise ConfigError(f"{e}: drop --whiten, or pass --no-whiten") from None

    whitened = whitening if cfg.whiten else None
    files = RunFiles(cfg, env)
    checkpoints = Checkpoints(cfg, env, log, files)
    resumed = checkpoints.choose()  # first: a resume does not read --init-from's weights
    load_weights = _weights_loader(cfg, env, log, stop, resumed)
    state = TrainState.create(
        cfg, len(ds.classes), ds.image_shape, env, len(batches), whitened, load_weights, train.labels
    )
    table = _log_model(cfg, env, log, ds, state.model)
    for line in _exactness(cfg, env, state):
        log.info(line)
    if resumed:
        checkpoints.resume(state, resumed)
    files.open(state.epoch if resumed else None, state.step, log)
    files.write_text(options.ARGS_FILE, options.args_yaml(flags, command or shlex.join([sys.executable, *sys.argv])))
    if table:
        files.write_text(MODEL_SUMMARY, table)
    state.join_workers(env)
    if env.carrier.note:
        log.info(env.carrier.note)

    val = None
    feed = Feed(env.device)
    levels = chance.LossLevels.of(train.labels, len(ds.classes), cfg.label_smoothing)
    session = Session(
        cfg,
        env,
        log,
        state,
        files,
        checkpoints,
        stop=stop,
        batches_per_epoch=len(batches),
        resumed=resumed,
        levels=levels,
        eval_images=len(val_split),
        hooks=hooks,
    )
    with session:
        while session.training():
            if line := finetune.set_rates(state.model, state.loaded, cfg, state.epoch):
                log.info(line)
            epoch_batches = batches.epoch(state.epoch, state.batch_in_epoch, session.batch_count(), stage=feed.host)
            epoch = engine.Epoch(state, epoch_batches, cfg, env, log, feed)
            for _ in epoch:
                session.after_step(epoch.loss_sum)
            state.average_statistics(env)
            # --tta costs two to six passes: it scores every epoch only where --target-acc judges them
            alive = session.watchdog.alive
            val = evaluation.evaluate(state.evaluated_model, val_split, ds, cfg, env, alive, tta=tta_each_epoch(cfg))
            if session.end_epoch(epoch.stats, val):
                break
    if session.ended_on_best:  # --patience: the test score, model.pdparams and the export are the best epoch's
        checkpoints.restore_best(state)
        val = None
    return _finish(cfg, env, log, state=state, files=files, session=session, ds=ds, test=test, last_eval=val)


def _finish(
    cfg: Config,
    env: DistEnv,
    log: logging.Logger,
    *,
    state: TrainState,
    files: RunFiles,
    session: Session,
    ds: data.Dataset,
    test: data.Split,
    last_eval: evaluation.EvalStats | None,
) -> dict:
    """The last weights, the test score (last_eval when the last evaluation was on the test split), results,
    export; then chance.LearnedNothing, on every rank alike, when the run stalled or its test accuracy is no better
    than chance."""
    net = distributed.unwrap(state.evaluated_model)
    files.save_weights(net)
    reuse = last_eval is not None and ds.val_is_test and (tta_each_epoch(cfg) or not cfg.tta)
    final = last_eval if reuse else evaluation.evaluate(net, test, ds, cfg, env, tta=True)
    verdict = session.verdict(final.acc, chance.AccuracyLevel.of(test.labels, len(ds.classes)))
    peak_mb = memory_mb()[1]  # rank 0's in results.json; each rank's in its log
    best = state.best
    result = {
        "test_loss": final.loss,
        "test_acc": final.acc,
        "test_count": final.count,
        "steps": state.step,
        "world_size": env.world_size,
        "global_batch_size": cfg.batch_size,
        "wall_time_s": session.elapsed(),
        "peak_rss_mb": peak_mb,
        "best": {k: v for k, v in best.items() if k != "digest"} if best else None,
        "exported": cfg.export if best else "last",
        **verdict.fields(),
    }
    files.write_json(RESULTS, result)
    _write_report(cfg, env, log, files, ds, test, final)
    session.meet(state.step)  # training is over: a signal from here on lets the run finish; a failed write stops it
    log.info(f"parameters sha256 {checkpoint.digest(net)}")
    log.info(
        f"finished: test accuracy {final.acc:.4f} on {final.count} images, loss {final.loss:.4f}; "
        f"peak memory {peak_mb:.0f} MiB; "
        f"weights in {os.path.join(cfg.output_dir, WEIGHTS)}"
    )
    files.finish()
    # last: if paddle.jit.save fails, weights and results are written. The other ranks wait in the key-value store,
    # not a collective that gives up at 30 s (a busy machine's export can take longer); the meeting is the last, and
    # a signal from here on lets the run finish
    with waiting.Meeting("export", "rank 0's export of the inference model", env, log, lambda: 0) as meeting:
        failed = _export(cfg, files, net, ds, best)
        if meeting.finish(failed is None):
            raise failed or ExportFailed("rank 0 could not export the inference model; its message is in workerlog.0")
    if verdict.message:
        raise chance.LearnedNothing(verdict.message)
    return result


def _write_report(
    cfg: Config,
    env: DistEnv,
    log: logging.Logger,
    files: RunFiles,
    ds: data.Dataset,
    test: data.Split,
    final: evaluation.EvalStats,
) -> None:
    """OUTPUT_DIR/report/: the test score by class, from the final evaluation's confusion matrix (every rank's
    share, all-reduced), with the first images of the most confused pairs (each rank sends its first few of those
    pairs). Every rank takes part; rank 0 writes."""
    pairs = scores.worst_pairs(final.confusion)
    examples = evaluation.confused_examples(final, pairs, env)
    where = cfg.data_dir or cfg.labels or str(REPO_DATA / cfg.dataset)
    about = {"split": "test", "dataset": cfg.dataset, "data": where}
    contents = scores.report(final.confusion, ds.classes, final.top_k, examples, {**about, "weights": WEIGHTS})
    if env.is_main:
        files.write_report(contents, {i: np.asarray(test.images[i]) for found in examples.values() for i in found})
    where = Path(cfg.output_dir) / report.FOLDER
    log.info(f"test report in {where} ({report.REPORT_FILE}, {report.CONFUSION_FILE}, {report.PAIRS_FILE})")
    for line in scores.summary(contents):
        log.info(f"test report: {line}")


class ExportFailed(RuntimeError):
    """paddle.jit.save failed after training; the weights and results were written before it."""


def _export(
    cfg: Config, files: RunFiles, net: paddle.nn.Layer, ds: data.Dataset, best: dict | None
) -> ExportFailed | None:
    """None, or the error to raise on every rank once they all know (rank 0 exports alone).

    --export best exports model_best.pdparams; a run that never evaluated has no best and exports the last weights.
    """
    weights = "last"
    try:
        if cfg.export == "best" and best and files.enabled:
            net = build_model(cfg.model, len(ds.classes), ds.image_shape)
            checkpoint.set_weights(net, checkpoint.load(Path(files.out) / BEST_WEIGHTS), Path(files.out) / BEST_WEIGHTS)
            weights = f"best: epoch {best['epoch']}, validation accuracy {best['val_acc']:.4f}"
        elif cfg.sync_bn and files.enabled:  # export plain batch norm: a CPU predictor has no kernel for SyncBatchNorm
            net = distributed.plain_batch_norm(net, build_model(cfg.model, len(ds.classes), ds.image_shape))
        files.export_inference(net, ds, weights)
    except Exception as e:
        out = cfg.output_dir
        failed = ExportFailed(
            f"exporting the inference model to {os.path.join(out, 'inference')} failed ({type(e).__name__}: {e}); "
            f"nothing else is lost: the weights are in {os.path.join(out, WEIGHTS)} and the results in "
            f"{os.path.join(out, RESULTS)}. Fix the cause, then run the same command with --resume yes: "
            "it loads the finished run's last checkpoint and exports again without training"
        )
        failed.__cause__ = e
        return failed
    return None
