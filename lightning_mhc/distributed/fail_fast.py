"""Fail fast: an exception on one rank ends every rank of the job within seconds.

Without this, a stage that raises leaves its peers waiting in a point-to-point receive or a
collective until the strategy's timeout (10 minutes by default), and they report only gloo's
timeout. Here:

- a rank whose run raises (the Trainer's ``Strategy.on_exception``; with Fabric or a loop of
  one's own, an exception nothing catches, through ``sys.excepthook``) says so on stderr at once,
  and writes who it is and what it raised under one key of the job's rendezvous store (the TCP
  store every rank reaches already); the first failure wins. A process about to exit that way
  first lingers two polls, so that the others read it before the store goes with rank 0;
- every rank runs a watch thread, with its own connection to that store, that looks at the key
  every ``poll_s``; when another rank has failed while this rank's main thread waits on its peers
  (the schedule, gradient reduction, a barrier: :meth:`FailFast.waiting`) and still waits
  ``grace_s`` later, it writes ``lightning_mhc: rank R stops: rank F failed: <Type>: <message>``
  to stderr and exits with status 1. gloo's waits cannot be interrupted, so the process exits
  rather than raising;
- a rank that raised itself is left to its own exception (all ranks raising the same error
  each report it as usual), and a rank that is not waiting on its peers is left alone;
- when gloo notices first (the failed process has exited: "Connection closed by peer"), the
  error a waiting rank raises is :class:`PeerFailure`, with the same message, from gloo's; an
  error of this rank's own code (a refusal every rank raises) stays what it is;
- one watch runs per process: a new run's replaces the last one's, and it is stopped and joined
  before the interpreter shuts down. A daemon thread still inside a store call at shutdown would
  abort the process ("terminate called without an active exception") when the call returns and
  finds the interpreter gone.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import threading
from typing import Iterator

import torch.distributed as dist

KEY = "lightning_mhc/failure"
STORE_TIMEOUT = datetime.timedelta(seconds=5)
"""How long one store call of the watch may block (bounds the join at exit)."""
_running: FailFast | None = None
"""The process's watching instance (one at a time)."""
_previous_excepthook = sys.excepthook


class PeerFailure(RuntimeError):
    """This rank stopped because another rank's run raised (the message names both)."""


class FailFast:
    """One per process: :meth:`start` once the default process group exists."""

    def __init__(self, poll_s: float = 0.5, grace_s: float = 2.0) -> None:
        self.poll_s, self.grace_s = poll_s, grace_s
        self._store = None
        """The main thread's connection to the job's store; the watch thread has its own."""
        self._rank = 0
        self._who = "rank 0"
        self._waiting = 0
        self._failed_here = False
        self._seen: str | None = None
        """The failure the watch thread last saw (the store may be gone with rank 0's process)."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, who: str) -> None:
        """In every rank (a collective): clear an earlier run's failure, watch for this run's.
        ``who`` names this rank in the messages (its global rank and place in the layout)."""
        self._who = who
        self._rank = dist.get_rank()
        if self._store is None:
            self._store = _own_store_connection()
        if self._store is None:  # not rendezvoused through a TCP store: nothing to watch
            return
        if self._rank == 0:
            self._store.delete_key(KEY)
        self._failed_here, self._seen = False, None
        dist.barrier()
        global _running
        if self._thread is None:
            if _running is not None:
                _running.stop()
            watch_store = _own_store_connection()
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, args=(watch_store,), name="lightning_mhc-fail-fast",
                                            daemon=True)
            self._thread.start()
            _running = self
            atexit.unregister(_stop_watching)  # registered last, run first: before the groups go
            atexit.register(_stop_watching)
        if sys.excepthook is not _publishing_excepthook:
            global _previous_excepthook
            _previous_excepthook, sys.excepthook = sys.excepthook, _publishing_excepthook

    def stop(self) -> None:
        """End the watch and wait for it (its store call returns within ``STORE_TIMEOUT``)."""
        global _running
        if self._thread is not None:
            self._stop.set()
            self._thread.join(self.poll_s + self.grace_s + 2 * STORE_TIMEOUT.total_seconds())
            self._thread = None
        if _running is self:
            _running = None

    def publish(self, exception: BaseException) -> None:
        """This rank's run raised ``exception``: tell the others (the first failure is kept)."""
        self._failed_here = True
        if self._store is None or not isinstance(exception, Exception) or isinstance(exception, PeerFailure):
            return  # KeyboardInterrupt / SystemExit: the preemption path ends every rank itself
        message = f"{self._who} failed: {type(exception).__name__}: {exception}".splitlines()[0][:500]
        os.write(2, f"lightning_mhc: {message}\n".encode())  # now: this process may be ended before its traceback
        try:
            self._store.compare_set(KEY, "", message)
        except Exception:  # the store's host is gone: the others notice the lost peer anyway
            pass

    def publish_uncaught(self, exception: BaseException) -> None:
        """An exception nothing caught is about to end this process (``sys.excepthook``): publish
        it, unless the run's own hook has, and give the others' watches two polls to read it."""
        if self._store is None or self._failed_here or not _has_peers() or not isinstance(exception, Exception) \
                or isinstance(exception, PeerFailure):
            return
        self.publish(exception)
        self._stop.wait(2 * self.poll_s)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The main thread waits on its peers inside this block."""
        self._waiting += 1
        try:
            yield
        except Exception as error:
            failure = None if self._failed_here or not _lost_peer(error) else \
                self._seen or (self._store and _failure(self._store))
            if failure:
                raise PeerFailure(f"{self._who} stops: {failure}") from error
            raise
        finally:
            self._waiting -= 1

    def _watch(self, store) -> None:
        while not self._stop.wait(self.poll_s):
            failure = _failure(store)
            if failure is None or self._failed_here:
                continue
            self._seen = failure
            if not self._waiting:
                continue
            # ranks raising the same error at once each report their own
            if self._stop.wait(self.grace_s) or self._failed_here or not self._waiting:
                continue
            os.write(2, f"lightning_mhc: {self._who} stops: {failure}\n".encode())
            sys.stderr.flush()
            os._exit(1)


def _publishing_excepthook(kind, value, traceback) -> None:
    """An exception nothing caught ends this process: tell the other ranks first (the Trainer's
    ``on_exception`` has done so already; Fabric and hand-written loops have no such hook)."""
    if _running is not None:
        try:
            _running.publish_uncaught(value)
        except Exception:  # the store is gone: the others notice the lost peer anyway
            pass
    _previous_excepthook(kind, value, traceback)


def _has_peers() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _stop_watching() -> None:
    if _running is not None:
        _running.stop()


def _lost_peer(error: Exception) -> bool:
    """An error of the wait itself (gloo's or the backend's), not of this rank's own code."""
    return isinstance(error, dist.DistError) or "gloo" in str(error)


def _failure(store) -> str | None:
    """The failure a rank published, if any."""
    try:
        if store.check([KEY]):
            return store.get(KEY).decode()
    except Exception:  # the store's host (rank 0's process) is gone: gloo reports the lost peer
        return None
    return None


def _own_store_connection():
    """A client of the job's TCP store (one per thread: a connection is not shared between
    threads), or None when the job did not rendezvous through ``MASTER_ADDR``."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        return None
    try:
        return dist.TCPStore(address, int(port), is_master=False, timeout=STORE_TIMEOUT,
                             wait_for_workers=False)
    except Exception:
        return None
