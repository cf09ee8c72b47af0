"""Clients side by side: a small pool of one-thread worker processes under the engine.

On a CPU, small convolutions scale poorly across threads, so a run uses the cores by training several
clients at once, one per process. The workers are forked from the ready simulation (data loaded, the
augmentation's set-up exchange done, the algorithm initialised), so they share the federation's
tensors with the parent (copy-on-write pages: nothing is copied per round) and hold their own copy of
the algorithm as it was at the fork. The engine sends a worker a task, a module-level function and its
arguments (a sampled client's server message and state; or a share of the evaluation), and the worker
returns the result. What a local update may depend on is therefore only what the protocol passes it:
the message, the client state, the client's data and its random stream, and the algorithm's settings
and initialisation; a test runs every method both ways and compares the numbers.

PyTorch refuses every backward pass in a process forked after autograd started threads of its own ("Unable
to handle autograd's threading in combination with fork-based multiprocessing"): it does at the first backward
pass on a machine with a GPU (one thread per GPU, whatever device the pass ran on, e.g. after training on CUDA)
and at a backward pass nested deep in another (a thread for the deeper ones). So the pool forks only when a
child forked now can run a backward pass (:func:`fork_is_safe`); else it spawns its workers, fresh interpreters
that receive the simulation as ``torch.save``'s bytes (its tensors with their views and layouts; a copy per
worker instead of shared pages, and a few seconds to start).

Every task runs with one thread in whichever process runs it (the engine sets one thread for the whole
run), so a run's numbers never depend on the number of workers, nor on how they were started. A worker that
dies stops the run with a :class:`WorkerDiedError` naming the client and round; the workers never outlive the
pool (they end with it, and with their parent if it is killed).
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import io
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
import types
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

import torch


class WorkerDiedError(RuntimeError):
    """A worker process ended in the middle of a task (killed, out of memory, a crash in native code)."""


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def end_with_parent(parent: int, every: float = 0.5) -> None:
    """End this process when its parent dies, so no worker outlives a killed or terminated run: Linux's parent-death
    signal where it takes (a forked worker), and a watcher thread that ends the process within `every` seconds of
    the parent's death where it does not (a spawned one: its parent-death signal follows the thread that started
    it, not the process)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="end-with-parent").start()


def fork_is_safe() -> bool:
    """Whether a process forked from this one now can run a backward pass (see the module): nothing tells whether
    autograd has started its threads here, so a child forked for the purpose tries one, and exits saying."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            torch.ones(1, requires_grad=True).sum().backward()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


class _Saved:
    """An object as ``torch.save``'s bytes, for a spawned worker: its tensors arrive with their views, strides
    and dtypes as they were (plain pickling copies each view of a tensor on its own)."""

    def __init__(self, obj: Any):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        self.data = buffer.getvalue()

    def load(self) -> Any:
        return torch.load(io.BytesIO(self.data), weights_only=False)  # this process's own bytes


@contextlib.contextmanager
def _main_unseen():
    """Inside the block a spawned process is not told of this one's main module, so it does not run the script
    again (which a script without Python's ``if __name__ == "__main__":`` guard does not survive): a worker needs
    only this library."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class _Channel:
    """One end of a pipe carrying pickled tasks and results.

    Tensors travel as numpy arrays (their bytes, copied once), not through torch's shared-memory
    reductions, which create a shared-memory file per tensor and pass its descriptor over a socket: far
    slower for the many small messages of a round. Between two resets a tensor already sent is sent as a
    reference and arrives as the same object, as in one process, where every client of a round is handed
    the same global-weights tensor: one copy per worker and round instead of one per client.
    """

    def __init__(self, conn: Connection):
        self.conn = conn
        self.sent: dict[int, int] = {}       # id(tensor) -> index, since the last reset
        self.keep: list[torch.Tensor] = []   # the tensors behind those ids, alive until the reset
        self.received: list[torch.Tensor] = []

    def send(self, obj: Any, reset: bool = True) -> None:
        if reset:
            self.sent, self.keep = {}, []
        buffer = io.BytesIO()
        buffer.write(b"\x01" if reset else b"\x00")
        pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = self._tensor_id
        pickler.dump(obj)
        self.conn.send_bytes(buffer.getbuffer())

    def _tensor_id(self, obj: Any):
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu" or obj.requires_grad \
                or obj.dtype == torch.bfloat16:  # numpy has no bfloat16: such a tensor is pickled by torch
            return None
        if id(obj) in self.sent:
            return ("ref", self.sent[id(obj)])
        self.sent[id(obj)] = len(self.keep)
        self.keep.append(obj)
        return ("new", obj.numpy())

    def recv(self) -> Any:
        data = self.conn.recv_bytes()
        if data[0]:
            self.received = []
        unpickler = pickle.Unpickler(io.BytesIO(memoryview(data)[1:]))
        unpickler.persistent_load = self._tensor
        return unpickler.load()

    def _tensor(self, pid) -> torch.Tensor:
        kind, value = pid
        if kind == "ref":
            return self.received[value]
        self.received.append(torch.from_numpy(value))
        return self.received[-1]


def _portable(err: BaseException) -> BaseException:
    """The exception itself if it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


_PROGRESS = None  # in a worker: the shared value where it says which task of its chunk it is on


def _run_chunk(state: Any, fn: Callable, arglist: list[tuple]) -> list[tuple[bool, Any]]:
    """``fn(state, *args)`` for each args: ``(True, result)`` or ``(False, exception)`` each."""
    out = []
    for k, args in enumerate(arglist):
        if _PROGRESS is not None:
            _PROGRESS.value = k
        try:
            out.append((True, fn(state, *args)))
        except Exception as err:
            out.append((False, _portable(err)))
    return out


def _serve(state: Any, conn: Connection, inherited: Sequence[Connection], parent: int, progress) -> None:
    """A worker's loop: run each task ``(fn, args)`` as ``fn(state, *args)`` until told to stop."""
    global _PROGRESS
    _PROGRESS = progress
    for c in inherited:  # the parent's ends of the pipes: only the parent may hold them open
        c.close()
    end_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes the pool
    torch.set_num_threads(1)
    if isinstance(state, _Saved):  # a spawned worker
        state = state.load()
    channel = _Channel(conn)
    tasks: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        # Tasks are read as they come, so the parent's sends never wait on this worker's computation
        # (the parent queues a second task while this one sends a result: two full pipes would deadlock).
        while True:
            try:
                task = channel.recv()
            except (EOFError, OSError):  # the parent is gone
                task = None
            tasks.put(task)
            if task is None:
                return
    threading.Thread(target=read, daemon=True).start()
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args = task
        try:
            result = (True, fn(state, *args))
        except Exception as err:
            result = (False, _portable(err))
        channel.send(result)


class WorkerPool:
    """`workers` processes started now, each holding a copy of `state` (e.g. the simulation): forked, or spawned
    where a forked one could not train (see the module).

    Use as a context manager; :meth:`map` runs tasks on them. Linux only.
    """

    SHARES = 4  # a chunk holds at most a SHARES-th of a worker's share of the remaining tasks
    MAX_CHUNK = 16  # and at most this many: a chunk's results (uploads) travel and wait in memory together
    DEPTH = 2  # chunks queued per worker: it starts the next as soon as it sends a result, without waiting
    #            for this (busy, often descheduled) parent to answer

    def __init__(self, state: Any, workers: int):
        # The first optimizer a process builds imports torch._dynamo (about a second). Imported here, the
        # workers inherit it instead of each paying for it again in every pool.
        import torch._dynamo  # noqa: F401

        fork = fork_is_safe()
        ctx = mp.get_context("fork" if fork else "spawn")
        try:
            sent = state if fork else _Saved(state)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            raise RuntimeError(f"workers: autograd has started threads in this process (as after training on a GPU), "
                               f"so no worker can be forked, and the simulation cannot be sent to spawned ones "
                               f"({str(err).splitlines()[0]}); use workers=1") from None
        self.conns: list[Connection] = []
        self.channels: list[_Channel] = []
        self.procs: list[mp.process.BaseProcess] = []
        self.progress = [ctx.RawValue("q", -1) for _ in range(workers)]  # the task a worker is on, in its chunk
        try:
            for i in range(workers):
                parent_end, child_end = ctx.Pipe()
                inherited = [*self.conns, parent_end] if fork else []  # a spawned worker inherits no pipe
                proc = ctx.Process(target=_serve, name=f"fedlab-worker-{i}", daemon=True,
                                   args=(sent, child_end, inherited, os.getpid(), self.progress[i]))
                with contextlib.nullcontext() if fork else _main_unseen():
                    proc.start()
                child_end.close()
                self.conns.append(parent_end)
                self.channels.append(_Channel(parent_end))
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def size(self) -> int:
        return len(self.procs)

    def map(self, fn: Callable, arglist: Sequence[tuple], describe: Callable[[int], str],
            costs: Sequence[float] | None = None) -> list[tuple[bool, Any]]:
        """``fn(state, *args)`` for every args, on the workers as they come free.

        Returns ``(True, result)`` or ``(False, exception)`` per task, in the order given. A worker that
        dies raises :class:`WorkerDiedError` with ``describe(i)`` of a task it held (e.g. "training client
        3 in round 2"). Many small tasks travel in chunks, each a `SHARES`-th of a worker's share of what is
        left (guided scheduling): fewer messages and wake-ups of this process for the same work, and
        small chunks at the end, so the workers finish together. With `costs` (e.g. each client's number
        of samples) the costliest tasks go first. Neither changes any result: results are matched to their
        tasks, never combined here.
        """
        order = sorted(range(len(arglist)), key=lambda i: -costs[i]) if costs is not None else list(range(len(arglist)))
        chunks, start = [], 0
        while start < len(arglist):  # guided: big chunks first, then smaller ones so the workers end together
            size = min(self.MAX_CHUNK, max(1, -(-(len(arglist) - start) // (self.size * self.SHARES))))
            chunks.append(order[start:start + size])
            start += size
        results: list[Any] = [None] * len(arglist)
        todo = iter(chunks)
        queued: dict[Connection, collections.deque[list[int]]] = {conn: collections.deque() for conn in self.conns}
        first = set(self.conns)  # a worker's first task of this call resets what it holds by reference

        def feed(conn: Connection) -> None:
            chunk = next(todo, None)
            if chunk is not None:
                self.channels[self.conns.index(conn)].send((_run_chunk, (fn, [arglist[i] for i in chunk])),
                                                           reset=conn in first)
                first.discard(conn)
                queued[conn].append(chunk)

        for _ in range(self.DEPTH):
            for conn in self.conns:
                feed(conn)
        while any(queued.values()):
            for conn in wait([c for c, q in queued.items() if q]):
                chunk = queued[conn].popleft()
                try:
                    ok, value = self.channels[self.conns.index(conn)].recv()
                except (EOFError, OSError):
                    at = self.progress[self.conns.index(conn)].value  # the task of the chunk it was on
                    raise self._died(conn, describe(chunk[at if 0 <= at < len(chunk) else 0])) from None
                for i, result in zip(chunk, value):
                    results[i] = result
                feed(conn)
        return results

    def _died(self, conn: Connection, doing: str) -> WorkerDiedError:
        proc = self.procs[self.conns.index(conn)]
        proc.join(timeout=5)
        code = proc.exitcode
        how = (f"was killed by signal {-code} ({signal.Signals(-code).name}; out of memory is a common cause)"
               if code is not None and code < 0 else f"exited with status {code}")
        self.close()
        return WorkerDiedError(f"worker process {proc.pid} {how} while {doing}; the run stops (its last "
                               f"checkpoint is kept: run it again to resume, with workers=1 to stay in one process)")

    def close(self) -> None:
        """Stop every worker and wait for it; idempotent."""
        for channel in self.channels:
            try:
                channel.send(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.channels, self.procs = [], [], []
