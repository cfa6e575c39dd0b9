"""Random generator states in checkpoints: each rank's own (its CPU and its GPU generator), for every rank."""

from __future__ import annotations

from collections.abc import Sequence

import paddle
from paddle.base import core

from paddle_mnist.runtime.launch import gpu_index


def own_states(device: str, cpu_state: object, visible_gpu_states: Sequence) -> dict:
    """What a rank saves: the CPU generator and, on a GPU, its own device's generator only.

    A process holds one generator per visible GPU (paddle.get_rng_state() returns them all), but a worker draws
    from its own device's alone; the others are still at their seed and must not overwrite another rank's.
    """
    gpu = gpu_index(device)
    return {"device": device, "cpu": cpu_state, "gpu": visible_gpu_states[gpu] if gpu is not None else None}


def to_restore(saved: Sequence[dict], rank: int, world_size: int, device: str) -> tuple[dict, str | None]:
    """The states this rank restores ({"cpu": state or None, "gpu": state or None}) and one warning line naming
    what the checkpoint holds that this job cannot use, or lacks, or None when every rank finds its own.

    A checkpoint of 4 GPU workers resumes on 2 (ranks 2 and 3's states are dropped) or on CPU (the GPU states are
    dropped); the generators without a saved state keep what --seed gave them.
    """
    notes = []
    n = len(saved)
    if n > world_size:
        notes.append(f"the states of {_ranks(world_size, n)} are dropped ({n} workers saved, {world_size} now)")
    elif n < world_size:
        notes.append(f"no state is saved for {_ranks(n, world_size)} ({n} workers saved, {world_size} now)")
    entry = saved[rank] if rank < n else {}
    gpu = entry.get("gpu")
    lacking = n < world_size  # some rank of this job finds no state of its own
    if gpu is not None and gpu_index(device) is None:
        notes.append(f"rank {rank}'s GPU generator state is dropped (saved on {entry.get('device')}, now on CPU)")
        gpu = None
    elif gpu is None and entry and gpu_index(device) is not None:
        notes.append(f"rank {rank}'s GPU generator has no saved state (saved on {entry.get('device')})")
        lacking = True
    chosen = {"cpu": entry.get("cpu"), "gpu": gpu}
    if not notes:
        return chosen, None
    return chosen, (
        "warning: --resume: the checkpoint's random generator states do not match this job: "
        + "; ".join(notes)
        + (
            "; those generators start from --seed (the built-in models draw nothing from them in training; a layer"
            " of your own that does would not continue bit for bit)"
            if lacking
            else "; every generator of this job gets its own saved state back"
        )
    )


def _ranks(lo: int, hi: int) -> str:
    return f"rank {lo}" if hi - lo == 1 else f"ranks {lo}-{hi - 1}"


def current(device: str) -> dict:
    """This process's own_states, read from Paddle's generators."""
    return own_states(device, core.default_cpu_generator().get_state(), paddle.get_cuda_rng_state())


def apply(chosen: dict, device: str) -> None:
    """Set this process's CPU generator and its own GPU's generator; a None state leaves that generator as it is.

    Not paddle.set_rng_state: on a GPU it sets every visible GPU and refuses a list of another length, and on 2.6
    its device argument fails (it calls _convert_to_place on the string).
    """
    if chosen.get("cpu") is not None:
        core.default_cpu_generator().set_state(chosen["cpu"])
    gpu = gpu_index(device)
    if chosen.get("gpu") is not None and gpu is not None:
        core.default_cuda_generator(gpu).set_state(chosen["gpu"])
