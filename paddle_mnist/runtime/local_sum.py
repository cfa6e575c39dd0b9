"""The workers of one machine sum through shared memory: each writes its values into its own slot of one segment,
raises its flag, waits for every other flag, and adds the slots in rank order, so every worker holds the same bits.

Paddle's gloo all-reduce runs a ring over TCP in the calling thread, with two thread wake-ups a hop; here a sum is
one copy in, a wait on the others' flags (the training thread spins, then yields, then sleeps), and one pass over
the slots. The segment holds a line of 64 bytes a rank (its flag: the number of times it has raised it; its pid),
then two sets of slots used by the sums in turn: a rank enters sum s + 2, which overwrites set s % 2, only after
every rank raised its last flag of sum s + 1, which each does only after it has read sum s. x86's stores are seen in
the order they were made (the slot before the flag), so on other processors the workers keep to gloo (usable).

The float64 sums rounded into float32 gradients (sum_rounded_into: exact.py's, twice the bytes) are shared out: each
rank adds up one chunk of every part, its own, over the ranks, rounds it and hands the float32 result over, so a
rank copies in only the chunks the others add, and adds a chunk where every rank added all of them.

Nothing is left in /dev/shm: rank 0 creates the file under a name no other job can have (O_EXCL, random), every
rank maps it, and rank 0 removes the name before the first step; the memory lives until the last worker's mapping
goes, however the workers end.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable

import numpy as np
import paddle

DIRECTORY = "/dev/shm"
LINE = 64  # bytes: one rank's flag and pid, alone on a cache line
SPIN_CHECKS = 20_000  # flag checks (about 1 us each) before yielding, where every worker has a core of its own
YIELD_S = 0.002  # then os.sched_yield() for this long, then short sleeps
SLEEP_S = 0.0002
LIVENESS_S = 0.5  # how often a long wait looks whether the ranks it waits for still exist
DEADLINE_S = 30.0  # as gloo's own abort: a sum that waited this long raises, naming the ranks that never came


class Carrier:
    """What carries a process's sums over the workers: shared memory (a LocalSum) once distributed.wrap() opened it
    on a CPU job within one machine, else Paddle's collectives; `note` says which, for the start-up line."""

    def __init__(self) -> None:
        self.local: LocalSum | None = None
        self.note = ""


class SumTimeout(RuntimeError):
    """A rank did not enter a sum in time, or exited while the others waited for it (gone); the message names it,
    and ranks holds them."""

    def __init__(self, message: str, ranks: list[int], gone: bool = False):
        super().__init__(message)
        self.ranks, self.gone = ranks, gone


def usable() -> str | None:
    """Why shared memory cannot carry the sums on this machine, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the processor is {platform.machine()}, whose stores may be seen out of order (x86 only)"
    if not os.path.isdir(DIRECTORY):
        return f"{DIRECTORY} does not exist"
    return None


def slot_bytes(capacity: int) -> int:
    """A slot's size for values of capacity bytes: whole cache lines."""
    return -(-capacity // LINE) * LINE


def segment_bytes(world: int, capacity: int) -> int:
    return LINE * world + 2 * world * slot_bytes(capacity)


class LocalSum:
    """One job's sums over the workers of this machine, through one mapped segment (see the module's docstring)."""

    def __init__(self, path: str, rank: int, world: int, capacity: int, fd: int, deadline_s: float = DEADLINE_S):
        self.path, self.rank, self.world, self.capacity = path, rank, world, slot_bytes(capacity)
        self.deadline_s = deadline_s
        try:
            self._map = mmap.mmap(fd, segment_bytes(world, capacity))
        finally:
            os.close(fd)
        header = np.frombuffer(self._map, dtype=np.int64, count=LINE * world // 8)
        self._flags = header[0 :: LINE // 8]  # a strided view: one int64 a rank, 64 bytes apart
        self._pids = header[1 :: LINE // 8]
        self._pids[rank] = os.getpid()
        self._raised = 0  # this rank's flag: how many times it has raised it
        self._sums = 0  # the sums entered, which take the two sets in turn
        self._oversubscribed = world > len(os.sched_getaffinity(0))  # the cores this process may run on

    @classmethod
    def create(cls, world: int, capacity: int, deadline_s: float = DEADLINE_S) -> LocalSum:
        """Rank 0's: a new segment of its own name. OSError where /dev/shm cannot hold it or cannot be written."""
        path = os.path.join(DIRECTORY, f"paddle_mnist-{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, segment_bytes(world, capacity))  # the pages now, not a SIGBUS mid-step
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(path, 0, world, capacity, fd, deadline_s)

    @classmethod
    def attach(cls, path: str, rank: int, world: int, capacity: int, deadline_s: float = DEADLINE_S) -> LocalSum:
        """Another rank's: rank 0's segment, checked to be the size this job's would be."""
        fd = os.open(path, os.O_RDWR)
        if os.fstat(fd).st_size != segment_bytes(world, capacity):
            os.close(fd)
            raise OSError(f"{path} is not this job's segment (its size differs)")
        return cls(path, rank, world, capacity, fd, deadline_s)

    def unlink(self) -> None:
        """Remove the segment's name (rank 0, once every rank has mapped it); the mappings stay."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._flags = self._pids = None
        self._map.close()

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    def _slot(self, which: int, rank: int, like: np.ndarray, offset: int = 0) -> np.ndarray:
        """The piece of rank's slot in set which that starts offset bytes in, shaped like like."""
        start = LINE * self.world + (which * self.world + rank) * self.capacity + offset
        return np.frombuffer(self._map, dtype=like.dtype, count=like.size, offset=start).reshape(like.shape)

    def _enter(self, parts: list[np.ndarray], scale: float | None) -> int:
        """Copy the parts (times scale) one after another into this rank's slot of the next sum's set, raise the
        flag and wait for every rank's; the set."""
        self._sums += 1
        which = self._sums % 2
        offset = 0
        for part in parts:
            mine = self._slot(which, self.rank, part, offset)
            if scale is None:
                np.copyto(mine, part)
            else:
                np.multiply(part, part.dtype.type(scale), out=mine)
            offset += part.nbytes
        self._meet()
        return which

    def _meet(self) -> None:
        """Raise this rank's flag, after every store before it (x86 makes them visible in this order), and wait
        until every rank has raised its flag as often."""
        self._raised += 1
        self._flags[self.rank] = self._raised
        self._wait(self._raised)

    def sum_into(self, parts: list[np.ndarray], scale: float | None = None) -> None:
        """Replace each part (contiguous arrays of one dtype, writable) by its sum over the ranks, each rank's
        times scale if given, added in rank order: the same bits on every rank."""
        which = self._enter(parts, scale)
        offset = 0
        for part in parts:
            self._add_up(which, part, offset, part)
            offset += part.nbytes

    def _add_up(self, which: int, like: np.ndarray, offset: int, out: np.ndarray) -> None:
        """Every rank's piece of set which (like's shape and dtype, offset bytes into the slots), added in rank order
        in like's dtype, into out: the first two in one pass (the same bits as a copy of the first, then +=)."""
        first = self._slot(which, 0, like, offset)
        if self.world == 1:
            np.copyto(out, first, casting="same_kind")
            return
        np.add(first, self._slot(which, 1, like, offset), out=out, casting="same_kind")
        for r in range(2, self.world):
            out += self._slot(which, r, like, offset)

    def sum_rounded_into(self, parts: list[np.ndarray], outs: list[np.ndarray]) -> None:
        """Each part's sum over the ranks, added in rank order in the parts' dtype as sum_into adds them, rounded
        once into its out, an array of a narrower dtype (float64 sums into float32 gradients): the same bits as
        sum_into and a cast. Shared out (the module's docstring): chunk c of each part (its c-th of world nearly
        equal runs of elements) is added up by rank c, which reads its own values where they are and the others'
        from their slots, and rounds the sum into its out and into its own slot's chunk c, where the others copy
        it from. The parts keep their values."""
        if self.world == 1:
            for part, out in zip(parts, outs):
                np.copyto(out, part, casting="same_kind")
            return
        self._sums += 1
        which = self._sums % 2
        chunked = _chunked(parts, outs, self.world)
        for part, _, runs in chunked:  # the chunks the other ranks add up
            for c, (lo, hi, at) in enumerate(runs):
                if c != self.rank:
                    np.copyto(self._slot(which, self.rank, part[lo:hi], at), part[lo:hi])
        self._meet()
        for part, out, runs in chunked:  # this rank's chunk, over the ranks in order, rounded once
            lo, hi, at = runs[self.rank]
            mine = part[lo:hi]
            pieces = [mine if r == self.rank else self._slot(which, r, mine, at) for r in range(self.world)]
            if self.world == 2:  # numpy adds float64 inputs in float64 and rounds once into a float32 out
                np.add(pieces[0], pieces[1], out=out[lo:hi], casting="same_kind")
            else:
                total = pieces[0] + pieces[1]
                for piece in pieces[2:]:
                    total += piece
                np.copyto(out[lo:hi], total, casting="same_kind")
            np.copyto(self._slot(which, self.rank, out[lo:hi], at), out[lo:hi])
        self._meet()
        for _, out, runs in chunked:  # the others' chunks, rounded
            for c, (lo, hi, at) in enumerate(runs):
                if c != self.rank:
                    np.copyto(out[lo:hi], self._slot(which, c, out[lo:hi], at))

    def sum(self, values: np.ndarray, scale: float | None = None) -> np.ndarray:
        """A new array: values summed as sum_into sums a part."""
        total = np.array(values, copy=True, order="C")
        self.sum_into([total], scale)
        return total

    def max(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values)
        which = self._enter([values], None)
        top = self._slot(which, 0, values).copy()
        for r in range(1, self.world):
            np.maximum(top, self._slot(which, r, values), out=top)
        return top

    def _wait(self, entered: int) -> None:
        """Until every rank's flag reaches entered: spinning (where each worker has a core), then yielding the core,
        then sleeping; a rank that exits meanwhile, or a wait of deadline_s, raises SumTimeout naming the ranks."""
        flags = self._flags
        if flags.min() >= entered:
            return
        if not self._oversubscribed:
            for _ in range(SPIN_CHECKS):
                if flags.min() >= entered:
                    return
        began = time.monotonic()
        looked = began
        while flags.min() < entered:
            now = time.monotonic()
            if now - began < YIELD_S:
                os.sched_yield()
                continue
            time.sleep(SLEEP_S)
            if now - looked > LIVENESS_S:
                looked = now
                self._check(entered, now - began)

    def _check(self, entered: int, waited: float) -> None:
        late = [r for r in range(self.world) if self._flags[r] < entered]
        gone = [r for r in late if not _exists(int(self._pids[r]))]
        if gone:
            ranks = ", ".join(f"rank {r} (pid {self._pids[r]})" for r in gone)
            raise SumTimeout(f"{ranks} exited while the others waited for it in a sum over the workers", gone, True)
        if late and waited > self.deadline_s:
            ranks = ", ".join(f"rank {r}" for r in late)
            raise SumTimeout(
                f"{ranks} did not reach the sum over the workers within {self.deadline_s:.0f} s (stopped, hung or far "
                "slower than the others)",
                late,
            )


def _chunked(parts: list[np.ndarray], outs: list[np.ndarray], world: int) -> list[tuple]:
    """Each part and its out, flattened, with its chunks, one a rank: (first element, end, where in a slot it
    starts, in bytes), the part's values split into world nearly equal runs, the parts one after another in the
    slot as _enter lays them."""
    laid, offset = [], 0
    for part, out in zip(parts, outs):
        n = part.size
        runs = [(n * c // world, n * (c + 1) // world, offset + n * c // world * part.itemsize) for c in range(world)]
        laid.append((part.reshape(-1), out.reshape(-1), runs))
        offset += part.nbytes
    return laid


def _exists(pid: int) -> bool:
    """Whether the process runs (or is stopped): not gone, and not a zombie its parent has yet to reap."""
    if pid <= 0:
        return True  # not yet written: the rank has not mapped the segment, so it cannot be judged
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_on(
    carrier: Carrier, rank: int, world: int, local_size: int, cpu_sums: str, capacity: int, gather: Callable
) -> None:
    """Give carrier a shared-memory sum where every worker of the job is on this machine and it can be set up on
    every rank, else leave the sums to gloo; either way carrier.note says which and why. Every rank must call it
    (gather(obj): every rank's obj, in rank order): rank 0 creates the segment, the others map it, then rank 0
    removes its name."""
    problem = usable()
    if cpu_sums != "shared-memory":
        carrier.note = "sums over the workers: gloo (--cpu-sums gloo)"
        return
    if local_size < world:
        carrier.note = (
            f"sums over the workers: gloo, since the job spans machines ({local_size} of its {world} "
            "workers here); shared memory carries them only within one machine"
        )
        return
    if problem:  # the same machine for every rank: the same answer
        carrier.note = f"sums over the workers: gloo, since shared memory cannot carry them here: {problem}"
        return
    size = segment_bytes(world, capacity)
    mine: LocalSum | None = None
    path = ""
    if rank == 0:
        try:
            mine = LocalSum.create(world, capacity)
            path = mine.path
        except OSError as e:
            problem = (
                f"{DIRECTORY} could not take {size / 2**20:.1f} MiB ({e.strerror or e}); give it that much "
                "free space, writable (docker: --shm-size), to carry them there"
            )
    path, problem = gather((path, problem))[0]
    if rank != 0 and not problem:
        try:
            mine = LocalSum.attach(path, rank, world, capacity)
        except OSError as e:
            problem = f"rank {rank} could not map {path} ({e.strerror or e})"
    problems = [p for p in gather(problem) if p]
    if mine is not None and rank == 0:
        mine.unlink()  # every rank has mapped it or given up: nothing is left behind, however the job ends
    if problems:
        if mine is not None:
            mine.close()
        carrier.note = f"sums over the workers: gloo, since shared memory could not be set up: {problems[0]}"
        return
    carrier.local = mine
    carrier.note = (
        f"sums over the workers: shared memory ({size / 2**20:.1f} MiB, {world} workers on this machine), "
        "added in rank order"
    )


def average(local: LocalSum, grads: list, world: int) -> None:
    """Every gradient averaged over the workers in place: each worker's scaled by 1/N, then added in rank order,
    as DataParallel scales before its all-reduce."""
    by_dtype: dict[str, list[paddle.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(str(g.dtype), []).append(g)
    for group in by_dtype.values():
        views = [numpy_view(g) for g in group]
        if all(v is not None for v in views):  # the sums land in the gradients' own memory
            local.sum_into(views, scale=1.0 / world)
            continue
        flat = paddle.concat([g.reshape([-1]) for g in group]).numpy()
        write_back(group, local.sum(flat, scale=1.0 / world))


def sum_rounded(local: LocalSum | None, sums: list, targets: list) -> bool:
    """Each of sums (float64 tensors) summed over the workers and rounded once into its target (a float32 tensor of
    its shape): the same bits as a sum in place then a cast, each rank adding up its chunk (cifar_cnn's 10 MB of
    float64 sums a step: network/exact.py); False, having done nothing, where local cannot carry them (None, too
    small, or a tensor without a writable view)."""
    if local is None or not local.fits(sum(t.size * t.element_size() for t in sums)):
        return False
    views = [numpy_view(t) for t in sums + targets]
    if any(v is None for v in views):
        return False
    local.sum_rounded_into(views[: len(sums)], views[len(sums) :])
    return True


def numpy_view(t: paddle.Tensor) -> np.ndarray | None:
    """A writable numpy array over a CPU tensor's own memory (DLPack), or None where this Paddle and numpy do not
    give one (numpy before 2 marks DLPack arrays read-only; Paddle 2.6's tensors have no __dlpack__)."""
    try:
        view = np.from_dlpack(t.detach())  # the same memory; DLPack refuses a tensor that requires gradients
    except (AttributeError, TypeError, RuntimeError, BufferError):
        return None
    return view if view.flags.writeable and view.flags.c_contiguous else None


def write_back(tensors: list[paddle.Tensor], flat: np.ndarray) -> None:
    offset = 0
    for t in tensors:
        n = int(t.size)
        paddle.assign(paddle.to_tensor(flat[offset : offset + n].reshape(t.shape)), output=t)
        offset += n
