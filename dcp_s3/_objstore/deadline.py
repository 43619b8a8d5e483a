"""Request deadlines: no attempt of an S3 request runs past ``ClientConfig.request_deadline`` seconds.

botocore bounds each socket wait (``connect_timeout``, ``read_timeout``) but not a request as a whole: a
server that answers one byte per second never lets a read wait ``read_timeout``, and a PUT's answer or a
GET's body can trickle for hours. So each attempt of a request runs under a deadline, counted from when it
is sent (after its wait for a rate token, see :mod:`dcp_s3._objstore.rate_hooks`) to the last byte of its
answer, the body of a streamed GET included (read by :mod:`dcp_s3._objstore.s3` under
:func:`body_deadline`).

Enforced by one watchdog thread per process, never by the reading thread (which is blocked in a socket
call that keeps receiving a byte now and then). botocore gives no handle on the connection an attempt
uses, so when an attempt's deadline passes, the watchdog finds the socket that attempt's thread is blocked
on through the thread's stack (``sys._current_frames``: the innermost frame holding a socket, an
``http.client`` connection or a ``socket.SocketIO``) and shuts it down, at the TCP level, through a
duplicate of its descriptor. The thread's own read or write then fails as on a connection the server
closed, through its usual error path (urllib3 discards the connection); the attempt is not retried (a
server that slow does not recover within a retry) and fails with an ``S3TransferError`` naming the
operation, the object and the deadline. A deadline passed while the thread is between socket calls is cut
at its next one (checked every ``RECHECK_S``).
"""

from __future__ import annotations

import http.client
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from dcp_s3.errors import S3TransferError

__all__ = ["install_request_deadline", "body_deadline", "deadline_error"]

log = logging.getLogger(__name__)

RECHECK_S = 0.2  # a fired deadline whose thread was in no socket call is tried again this often
_WATCH = "dcp_s3.deadline_watch"  # the running attempt's watch, in the call's context
_OBJECT = "dcp_s3.deadline_object"  # s3://bucket/key of the call, for errors
_LOCAL = threading.local()  # the last attempt this thread sent: (start, seconds, operation, object)


class _Watch:
    """One attempt's deadline: ``until`` (monotonic) for thread ``ident``; ``fired`` once it passed."""

    __slots__ = ("ident", "until", "fired")

    def __init__(self, ident: int, until: float) -> None:
        self.ident, self.until, self.fired = ident, until, False

    def stop(self) -> None:
        with _WATCHDOG.cond:  # once this returns, no socket of the thread is cut for this watch
            _WATCHDOG.active.discard(self)


class _Watchdog:
    """The process's deadline thread (started on first use, in a forked child again). It keeps only the
    running attempts' watches (at most one per thread), so its memory does not grow with the requests sent."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.active: set[_Watch] = set()
        self._next = math.inf  # the deadline the thread waits for (inf: none); a later watch need not wake it
        self._started = False
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        """In a forked child: no thread, no watches, and a fresh lock (the parent's thread may have held it)."""
        self.cond, self.active, self._next, self._started = threading.Condition(), set(), math.inf, False

    def watch(self, until: float) -> _Watch:
        watch = _Watch(threading.get_ident(), until)
        with self.cond:
            if not self._started:  # no thread yet (in this process: see _forked)
                self._started = True
                threading.Thread(target=self._run, name="dcp_s3-deadlines", daemon=True).start()
            self.active.add(watch)
            if until < self._next:
                self._next = until
                self.cond.notify()
        return watch

    def _run(self) -> None:
        with self.cond:
            while True:
                if not self.active:
                    self._next = math.inf
                    self.cond.wait()
                    continue
                watch = min(self.active, key=lambda w: w.until)
                now = time.monotonic()
                if now < watch.until:
                    self._next = watch.until
                    self.cond.wait(watch.until - now)
                    continue
                watch.fired = True
                if _cut(watch.ident):
                    self.active.discard(watch)
                else:  # between socket calls: try again shortly
                    watch.until = now + RECHECK_S


_WATCHDOG = _Watchdog()


def _socket_in(frame: FrameType | None) -> Any:
    """The socket-like object (``socket.socket``, ``socket.SocketIO``, an ``http.client`` connection with a
    socket) held by the innermost frame from ``frame`` outwards that holds one, or None."""
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, (socket.socket, socket.SocketIO)):
                return value
            if isinstance(value, http.client.HTTPConnection) and isinstance(value.sock, socket.socket):
                return value.sock
        frame = frame.f_back
    return None


def _cut(ident: int) -> bool:
    """Shut down the connection thread ``ident`` is blocked on; whether one was found."""
    target = _socket_in(sys._current_frames().get(ident))
    if target is None:
        return False
    try:
        fd = target.fileno()
        if fd < 0:
            return False
        with socket.socket(fileno=os.dup(fd)) as dup:  # shuts the connection, not this descriptor's owner's object
            dup.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError):  # closed meanwhile: the attempt is over anyway
        return True
    log.debug("request past its deadline: connection of thread %d shut down", ident)
    return True


def deadline_error(action: str, where: str, seconds: float, cause: BaseException | None = None) -> S3TransferError:
    detail = f" ({type(cause).__name__} once its connection was cut)" if cause is not None else ""
    return S3TransferError(
        f"{action} {where} failed: no complete answer within ClientConfig request_deadline={seconds} s{detail}; "
        "the server is too slow or stalled (raise request_deadline for parts or objects that take longer)"
    )


@contextmanager
def body_deadline(action: str, where: str) -> Iterator[None]:
    """Read the body of the answer this thread just received within what is left of its attempt's deadline;
    past it (the connection is cut), an ``S3TransferError`` naming ``action``, ``where`` and the deadline,
    whatever the read returned. A no-op where the client has no deadline hooks."""
    attempt = getattr(_LOCAL, "attempt", None)
    if attempt is None:
        yield
        return
    start, seconds = attempt
    watch = _WATCHDOG.watch(start + seconds)
    try:
        yield
    except Exception as exc:
        if watch.fired:
            raise deadline_error(action, where, seconds, exc) from exc
        raise
    finally:
        watch.stop()
    if watch.fired:  # a body cut short can also read as one that ended early, without an error
        raise deadline_error(action, where, seconds)


def install_request_deadline(client: Any, seconds: float) -> None:
    """Register the handlers that put every attempt of ``client``'s requests under a ``seconds`` deadline."""
    hooks = _Hooks(seconds)
    events = client.meta.events
    events.register("before-parameter-build.s3", hooks.tag)
    events.register_last("request-created.s3", hooks.start)  # after the wait for a token and the signing
    events.register_last("needs-retry.s3", hooks.check)
    events.register_first("after-call-error.s3", hooks.stop)


class _Hooks:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def tag(self, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        bucket, key = params.get("Bucket"), params.get("Key", params.get("Prefix"))
        where = f"s3://{bucket}/{key}" if isinstance(key, str) else f"s3://{bucket}" if bucket else "(no bucket)"
        context[_OBJECT] = where

    def start(self, request: Any, **_: Any) -> None:
        context = getattr(request, "context", None)
        if context is None:
            return
        now = time.monotonic()
        _LOCAL.attempt = (now, self.seconds)
        context[_WATCH] = _WATCHDOG.watch(now + self.seconds)

    def check(
        self, request_dict: dict[str, Any], operation: Any, caught_exception: BaseException | None, **_: Any
    ) -> None:
        watch: _Watch | None = request_dict["context"].pop(_WATCH, None)
        if watch is None:
            return
        watch.stop()
        if watch.fired and caught_exception is not None:
            where = request_dict["context"].get(_OBJECT, "")
            log.warning("%s %s: no complete answer within request_deadline=%s s", operation.name, where, self.seconds)
            raise deadline_error(operation.name, where, self.seconds, caught_exception) from caught_exception

    def stop(self, context: dict[str, Any], **_: Any) -> None:
        watch: _Watch | None = context.pop(_WATCH, None)
        if watch is not None:
            watch.stop()
