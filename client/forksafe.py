"""Fork and pickle safety for everything a client process holds, in one place.

DataLoader workers are forked (or spawned) from a training process that is already reading:
its threads may be inside a gRPC call, holding a lock, or halfway through a socket exchange
at the moment of the fork. A child inherits the memory of all of that but none of the threads,
so a parent's lock may stay held forever, a pooled socket may be mid-reply, and a gRPC channel
is not the child's to use (grpc's own threads are gone). The rules, for every client module:

- What belongs to one process (locks, threads, sockets, gRPC channels, pools, held page
  descriptors, shared-memory maps, counter blocks) lives in a :class:`ProcessLocal`: built on
  first use in each process, dropped (never used, never closed in ways that reach the parent)
  in a forked child, and never pickled (a spawned child builds its own).
- What must act around a fork is a :class:`ForkHook`: it quiesces before the fork and resumes
  in the parent after it.
- A process forked from one that had loaded gRPC never calls gRPC (:func:`forbid_grpc`: a stub
  or a view watcher asked for there raises :class:`GrpcInheritedError` at once). Its copy of
  gRPC's core holds the parent's threads' state mid-call, and grpcio's fork support, whose
  handlers are meant to reset it, hung DataLoader workers at every epoch start. Such a process
  reads, lists and follows the view over the workers' own sockets (client/transport/bulkpaths.py).
- One ``os.register_at_fork`` handler calls them all. It is this module's only process-wide
  state, and it has to be: at-fork handlers are process-wide by nature.

The S3 Connector for PyTorch keeps its client the same way (one per-process holder, rebuilt by
pid); this module generalises it to every resource a cachefs client holds.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from cachefs.client.timeouts import BEFORE_FORK_BUDGET

log = logging.getLogger(__name__)

T = TypeVar("T")


class ForkHook:
    """Something that must act around ``fork()`` (subclass, override what applies, ``register``);
    all three run in the forking thread."""

    def before_fork(self, deadline: float) -> None:
        """Quiesce (leave gRPC calls, stop starting new ones) by ``deadline`` (time.monotonic())."""

    def after_fork_in_parent(self) -> None:
        """Resume what ``before_fork`` paused."""

    def after_fork_in_child(self) -> None:
        """Forget the parent's state; replace locks (a parent thread may have held one)."""


def time_left(deadline: float, cap: float = 2.0) -> float:
    """Seconds one hook may wait before a fork: what is left of the budget, at most ``cap``."""
    return max(0.0, min(cap, deadline - time.monotonic()))


class _Hooks:
    """The registered hooks of this process (weak: a hook ends with its owner)."""

    def __init__(self) -> None:
        self._hooks: weakref.WeakSet[Any] = weakref.WeakSet()
        self._guard = threading.Lock()
        self.forks_seen = 0

    def add(self, hook: ForkHook) -> None:
        with self._guard:
            self._hooks.add(hook)

    def discard(self, hook: ForkHook) -> None:
        with self._guard:
            self._hooks.discard(hook)

    def snapshot(self) -> list[Any]:
        with self._guard:
            return list(self._hooks)

    def before(self) -> None:
        deadline = time.monotonic() + BEFORE_FORK_BUDGET
        for hook in self.snapshot():
            try:
                hook.before_fork(deadline)
            except Exception:  # noqa: BLE001 - a hook must never stop a fork
                log.exception("before-fork hook %r failed", hook)

    def after_in_parent(self) -> None:
        for hook in self.snapshot():
            try:
                hook.after_fork_in_parent()
            except Exception:  # noqa: BLE001
                log.exception("after-fork (parent) hook %r failed", hook)

    def after_in_child(self) -> None:
        # Only the forking thread exists here: the guard may have been held by another thread.
        self._guard = threading.Lock()
        self.forks_seen += 1
        for hook in self.snapshot():
            try:
                hook.after_fork_in_child()
            except Exception:  # noqa: BLE001
                log.exception("after-fork (child) hook %r failed", hook)


_HOOKS = _Hooks()
os.register_at_fork(before=_HOOKS.before, after_in_parent=_HOOKS.after_in_parent,
                    after_in_child=_HOOKS.after_in_child)


def pid() -> int:
    """This process's id: the one place the client asks which process it is in (a value built
    for one process is never used in another; per-process values are ``ProcessLocal``s, state
    kept beside them compares ``pid()`` with the one it was made in)."""
    return os.getpid()


def grpc_inherited() -> bool:
    """Whether this process was forked from one that had loaded gRPC. Its first gRPC channel
    can then hang, holding the GIL, so the whole process stops (seen in about 1 of 10 DataLoader
    worker starts, with grpcio's fork support on or off): such a process never calls gRPC
    (:func:`forbid_grpc`) and reads over the workers' sockets instead."""
    return _HOOKS.forks_seen > 0 and "grpc" in sys.modules


def grpc_avoided() -> bool:
    """Whether this process keeps off gRPC: it must (:func:`grpc_inherited`), or it has not
    loaded gRPC: a training process that follows the view through the master's client port and
    reads over the workers' sockets, which stays so, so that the DataLoader workers it forks
    inherit no gRPC state. Such a process loads gRPC only for what no socket serves (a write, a
    worker with no socket in the view, a cluster on TLS), never to retry what a socket failed."""
    return "grpc" not in sys.modules or grpc_inherited()


class GrpcInheritedError(RuntimeError):
    """gRPC was asked for in a process forked from one that had loaded it (see the module doc)."""


def forbid_grpc(what: str) -> None:
    """Raise :class:`GrpcInheritedError` naming ``what`` if this process must not call gRPC."""
    if grpc_inherited():
        raise GrpcInheritedError(
            f"{what}: this process was forked from one that had loaded gRPC, and gRPC is never used "
            "in such a process (it can hang there); this operation has no other path yet. Use the "
            "DataLoader's multiprocessing_context='spawn' or 'forkserver' for it, or do it in the main process")


def freeze_inherited_heap() -> bool:
    """In a forked process, move every object it inherited to the collector's permanent
    generation (``gc.freeze``), once; True if it did. A forked DataLoader worker otherwise runs
    full collections over the whole parent heap (torch's modules, the training process's
    objects): each traversal writes to every object's header, which copies its page from the
    parent (copy-on-write), and costs that worker tens of microseconds of CPU a sample in a warm
    epoch of small objects (docs/performance.md, "A warm epoch at scale"). What it inherited
    lives as long as the parent's copy did; objects the worker makes itself are collected as usual.
    The Python documentation's own advice for fork without exec."""
    global _frozen_in
    if _HOOKS.forks_seen == 0 or _frozen_in == os.getpid():
        return False
    _frozen_in = os.getpid()
    gc.freeze()
    return True


_frozen_in = 0  # the process that froze its inherited heap (a fork of it has its own to freeze)


def register(hook: ForkHook) -> None:
    """Call ``hook`` around every fork of this process from now on (until it is garbage)."""
    _HOOKS.add(hook)


def unregister(hook: ForkHook) -> None:
    _HOOKS.discard(hook)


def grpc_fork_support() -> bool:
    """Whether gRPC's fork handlers will run in this process (read once, at grpc's import)."""
    from grpc._cython import cygrpc

    return bool(cygrpc.is_fork_support_enabled())


class _ForkSupportWarning:
    """Says once per process that grpcio's fork support is on while this process forks: its
    at-fork child handler can block a DataLoader worker before the worker runs any code."""

    def __init__(self) -> None:
        self.said = False

    def check(self) -> None:
        if self.said or "grpc" not in sys.modules:
            return  # a process that has not loaded gRPC has no at-fork handler of it (and loads none here)
        self.said = True
        try:
            enabled = grpc_fork_support()
        except Exception:  # noqa: BLE001 - an odd grpcio build: say nothing rather than fail a fork
            return
        if enabled:
            log.warning("forking with grpcio's fork support on (GRPC_ENABLE_FORK_SUPPORT=1 in the environment "
                        "when grpc was imported): its at-fork handler can hang the child (a DataLoader worker) "
                        "before it runs any code. Unset GRPC_ENABLE_FORK_SUPPORT, or give the DataLoader "
                        "multiprocessing_context='spawn' or 'forkserver'")


_FORK_SUPPORT_WARNING = _ForkSupportWarning()


class RpcGate(ForkHook):
    """Counts the threads inside this process's gRPC calls; before a fork it holds new calls and
    waits (bounded) for those inside to leave.

    gRPC supports a fork while channels are open but no call is active: its own at-fork handlers
    then reset the core in the child. With a thread inside a call they skip ("Other threads are
    currently calling into gRPC, skipping fork() handlers") and the child's first call can hang
    past its deadline (its event-engine threads are gone). A parent that is still reading (a
    training loop, the prefetcher) while DataLoader workers fork hits exactly that.
    """

    #: A call that finds a fork pending waits at most this long (then goes ahead).
    HOLD_MAX = 10.0

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0
        self._forking = False
        register(self)

    @property
    def inside(self) -> int:
        return self._inside

    def enter(self) -> None:
        """Before a thread calls into gRPC; pair with :meth:`leave` in ``finally``."""
        with self._cond:
            if self._forking:
                self._cond.wait_for(lambda: not self._forking, timeout=self.HOLD_MAX)
            self._inside += 1

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            if self._inside <= 0:
                self._cond.notify_all()

    def before_fork(self, deadline: float) -> None:
        _FORK_SUPPORT_WARNING.check()
        with self._cond:
            self._forking = True
            if not self._cond.wait_for(lambda: self._inside <= 0, timeout=time_left(deadline)):
                log.debug("forking with %d threads still inside gRPC calls", self._inside)

    def after_fork_in_parent(self) -> None:
        with self._cond:
            self._forking = False
            self._cond.notify_all()

    def after_fork_in_child(self) -> None:
        self._cond = threading.Condition(threading.Lock())  # the parent's callers do not exist here
        self._inside, self._forking = 0, False


class ForkSafeLock(ForkHook):
    """A lock that a forked child gets fresh (``with`` only): the parent's may be held by a
    thread that does not exist in the child, and would stay held there forever."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        register(self)

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._lock.__exit__(*exc)

    def locked(self) -> bool:
        return self._lock.locked()

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        return (ForkSafeLock, ())


class ProcessLocal(ForkHook, Generic[T]):
    """One value per process, built by ``factory`` on first use in that process.

    In a forked child the parent's value is dropped without being used: ``inherited`` (if
    given) is called with it, for what is safe to release there (closing the child's copy of a
    descriptor does not disturb the parent's); otherwise the value is only kept referenced, so
    that no finalizer of it runs in the child. Pickling carries the factory, never the value.
    """

    def __init__(self, factory: Callable[[], T], *, inherited: Callable[[T], None] | None = None,
                 name: str = "") -> None:
        self._factory = factory
        self._inherited = inherited
        self.name = name or getattr(factory, "__qualname__", "value")
        self._lock = threading.Lock()
        self._value: T | None = None
        self._pid = -1
        self._abandoned: list[Any] = []
        register(self)

    def get(self) -> T:
        value, pid = self._value, self._pid
        if pid == os.getpid():
            return value  # type: ignore[return-value]
        with self._lock:
            if self._pid != os.getpid():
                self._value = self._factory()
                self._pid = os.getpid()
            return self._value  # type: ignore[return-value]

    def peek(self) -> T | None:
        """This process's value if it was built, else None (never builds one)."""
        return self._value if self._pid == os.getpid() else None

    def clear(self, close: Callable[[T], None] | None = None) -> None:
        """Drop this process's value (``close`` it); the next ``get`` builds a new one."""
        with self._lock:
            value = self._value if self._pid == os.getpid() else None
            self._value, self._pid = None, -1
        if value is not None and close is not None:
            close(value)

    # -- ForkHook (a value that must quiesce for a fork registers a hook of its own) ---------------
    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        value, self._value, self._pid = self._value, None, -1
        if value is None:
            return
        if self._inherited is not None:
            try:
                self._inherited(value)
            except Exception:  # noqa: BLE001 - best effort; the child never uses it again
                log.debug("releasing the parent's %s in a forked child failed", self.name, exc_info=True)
        self._abandoned.append(value)

    # -- pickling -------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"factory": self._factory, "inherited": self._inherited, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["factory"], inherited=state["inherited"], name=state["name"])  # type: ignore[misc]
