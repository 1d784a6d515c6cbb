"""Run a function on N local ranks in one process group (gloo on CPU, NCCL on GPU), forked from
a fork server that has torch and the package imported once.

Used by the tests and the benchmarks. Every wait has a deadline; the first
rank to fail ends the whole group with that rank's traceback; no process is
left behind (survivors are terminated, then killed).
"""
from __future__ import annotations

import datetime
import fcntl
import os
import pickle
import queue
import random
import resource
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


PORT_LOCKS = os.environ.setdefault("LIGHTNING_MHC_PORT_LOCKS", os.path.join(tempfile.gettempdir(), "lightning_mhc_ports"))
"""One lock file per port a process of this machine holds for a group's store (``free_port``).
Named in the environment, so that a child process whose temporary folder is another one (the test
suite gives its children a folder of their own) draws ports from the same locks."""

_held_ports: dict[int, int] = {}
"""Port -> the descriptor of its lock file, for the ports this process holds."""


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for ``bind(0)`` and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999      # Linux's default


def free_port() -> int:
    """A TCP port for a process group's store, held for this process until :func:`release_port`
    (or its exit).

    A port taken with ``bind(0)`` and closed comes from the kernel's ephemeral range, from which
    every outgoing connection and every gloo listener of the other groups running beside this one
    also draws: one took such a port between the pick and the store's bind, and a group failed with
    EADDRINUSE. This port is drawn outside that range, where only an explicit bind can take it, and
    an exclusive lock on its file under ``PORT_LOCKS`` keeps every other process that picks ports
    here from choosing it while this one holds it. Where the ephemeral range leaves no room below
    it, the kernel's pick as before."""
    low, _ = _ephemeral_range()
    first = 20000 if low > 21000 else 1024
    if low - first < 1000:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    os.makedirs(PORT_LOCKS, exist_ok=True)
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(first, low)
        if port in _held_ports:
            continue
        fd = os.open(os.path.join(PORT_LOCKS, f"{port}.lock"), os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if _bindable(port):
            _held_ports[port] = fd
            return port
        os.close(fd)
    raise RuntimeError(f"no free port in [{first}, {low}) after 200 tries")


def release_port(port: int) -> None:
    """Let other processes pick ``port`` again (its group has ended)."""
    fd = _held_ports.pop(port, None)
    if fd is not None:
        os.close(fd)


def _bindable(port: int) -> bool:
    """Whether a store could bind ``port`` now (as it does: every address, SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    threads: int,
    init_group: bool,
    results: "mp.Queue",
    args: tuple,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    try:
        if init_group:
            torch.distributed.init_process_group(
                backend,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        out = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(out), _cpu_s()))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        results.put((rank, False, traceback.format_exc(), _cpu_s()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _cpu_s() -> float:
    """This rank's CPU seconds (user + system) so far: a forked rank starts from zero."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


ranks_cpu_s = 0.0
"""CPU seconds the ranks of this process's ``spawn_ranks`` calls reported: they are the fork
server's children, so ``getrusage(RUSAGE_CHILDREN)`` here never sees them (tests/cpu_time.py)."""


PRELOAD = ("torch", "torch.distributed", "megatron.core", "lightning_mhc.model.gpt", "lightning_mhc.distributed",
           "lightning_mhc.recompute")
"""Imported once by the fork server the ranks are forked from: a rank then starts in a fraction
of a second instead of importing torch and megatron-core again (seconds of CPU each). Read when
the server starts (a process's first ``spawn_ranks``): a caller whose ranks need more, such as
the test suite's (Lightning), adds to it before."""


def _context():
    """A fork server started clean (no threads, no process group: safe to fork from) with
    ``PRELOAD`` imported; spawned processes where there is none (not POSIX)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    init_group: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    ``fn`` must be importable (a module-level function). Returns the ranks'
    return values in rank order. Raises :class:`RankError` with the first
    failing rank's traceback, or :class:`TimeoutError` after ``timeout_s``.
    Collectives inside the group time out after ``timeout_s`` as well. With ``init_group=False``
    no process group is made: ``fn`` finds the variables torchrun sets (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``) and makes its own, as a Lightning
    strategy in processes started outside it does.
    """
    global ranks_cpu_s
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, backend, timeout_s, threads_per_rank, init_group, results, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        while len(outputs) < world_size:
            try:
                rank, ok, payload, cpu_s = results.get(timeout=0.2)
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if rank not in outputs and proc.exitcode not in (None, 0):
                        raise RankError(f"rank {rank} died with exit code {proc.exitcode}")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
                continue
            ranks_cpu_s += cpu_s
            if not ok:
                raise RankError(f"rank {rank} of {world_size} failed:\n{payload}")
            outputs[rank] = pickle.loads(payload)
        finished = True
    finally:
        _reap(procs, grace_s=10.0 if finished else 0.0)
        results.close()
        release_port(port)
    return [outputs[rank] for rank in range(world_size)]


def _reap(procs: list, grace_s: float) -> None:
    """Join the ranks; terminate (then kill) any still alive after ``grace_s``."""
    end = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
