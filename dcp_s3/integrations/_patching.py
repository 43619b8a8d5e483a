"""The one way an integration replaces a framework's function: scoped, re-entrant, exception-safe,
reference-counted, and dispatched per context.

A framework that calls its own functions by name (torch's ``_storage_setup``, Accelerate's
``save_fsdp_model``, NeMo's ``base_recipe.save_losses``…) gives an integration no argument to pass
its storage through; the integration replaces the attribute instead. Attributes of modules are
process-wide, a route is not: two jobs in one process (two threads, two asyncio tasks) each open
their own. So a :class:`ContextPatch` splits the two:

- the *attributes* are replaced when the first scope opens (anywhere in the process) and put back
  when the last one closes, normally or through an exception — a reference count, under a lock;
  replacing is all-or-nothing (a site that cannot be found or set leaves every attribute as it was);
- the *value* a replacement acts with (the options, the checkpointer…) belongs to the context that
  opened the scope (a ``contextvars`` stack: the innermost scope of this thread or task wins). A
  call made where no scope of this context is open runs the framework's original function,
  unchanged — unless the integration asks for another rule (``resolve``; :mod:`dcp_route` uses it
  for threads torch starts inside a block).

A replacement is made once per original function (``functools.wraps``: ``__wrapped__`` is the
original) and shared by every site that held that function; on close an attribute is put back only
where it still holds this patch's replacement (something replaced it after us: left to its owner).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dcp_s3.errors import DcpS3Error

__all__ = ["ContextPatch", "Handler", "Site"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: ``handler(value, original, *args, **kwargs)``: what a replaced function does while a scope is active
#: (``value``: the scope's); ``original`` is the framework's function, for calls the handler passes on.
Handler = Callable[..., Any]


@dataclass(frozen=True)
class Site:
    """One attribute to replace: ``owner.name`` (a module's or a class's; ``name`` is the attribute's, or with
    ``get``/``set`` a description of it), and what it does while a scope is active. ``get``/``set`` read and write it where its name may only be spelt in one module (torch's private
    names: :mod:`dcp_s3._torch_compat`); plain ``getattr``/``setattr`` otherwise."""

    owner: Any
    name: str
    handler: Handler
    get: Callable[[Any], Any] | None = None
    set: Callable[[Any, Any], None] | None = None

    def read(self) -> Any:
        return self.get(self.owner) if self.get is not None else getattr(self.owner, self.name)

    def write(self, value: Any) -> None:
        if self.set is not None:
            self.set(self.owner, value)
        else:
            setattr(self.owner, self.name, value)


class _Entry(Generic[T]):
    """One open scope (compared by identity: two scopes with equal values are still two)."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value


class ContextPatch(Generic[T]):
    """Replaces the attributes ``sites()`` names while at least one scope is open (see the module docstring).

    Args:
        label: what the patch is, for logs and the contextvar's name.
        sites: called when the first scope opens: the :class:`Site` s to replace. It may raise (a framework
            without the function): then nothing is replaced and the scope does not open.
        resolve: the value a call acts with, given this patch (default: :meth:`current`, the innermost scope of
            this context); None runs the original."""

    def __init__(
        self,
        label: str,
        sites: Callable[[], Iterable[Site]],
        *,
        resolve: Callable[[ContextPatch[T]], T | None] | None = None,
    ) -> None:
        self.label = label
        self._sites = sites
        self._resolve = resolve
        self._lock = threading.RLock()
        self._holds = 0  # open scopes and holds, every context
        self._open: list[_Entry[T]] = []  # open scopes, every context, in opening order
        self._replaced: list[tuple[Site, Any, Any]] = []  # (site, original, replacement)
        self._stack: contextvars.ContextVar[tuple[_Entry[T], ...]] = contextvars.ContextVar(
            f"dcp_s3_patch_{label}", default=()
        )

    # -- what a replaced function acts with ------------------------------------------------------------------

    def current(self) -> T | None:
        """The value of the innermost scope open in this context (thread or task), or None."""
        stack = self._stack.get()
        return stack[-1].value if stack else None

    def open_values(self) -> list[T]:
        """The values of every scope open now, in any context, in opening order."""
        with self._lock:
            return [entry.value for entry in self._open]

    @property
    def installed(self) -> bool:
        """Whether the framework's attributes are replaced now."""
        with self._lock:
            return bool(self._replaced)

    def value(self) -> T | None:
        """The value a replaced function acts with now (``resolve``, else :meth:`current`)."""
        return self._resolve(self) if self._resolve is not None else self.current()

    # -- scopes ------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self, value: T) -> Iterator[T]:
        """The replacements act with ``value`` in this context for the block (nested: the innermost's value);
        the attributes are the framework's again when the last scope anywhere closes. Yields ``value``."""
        entry = _Entry(value)
        with self._lock:
            self._acquire()
            self._open.append(entry)
        token = self._stack.set((*self._stack.get(), entry))
        try:
            yield value
        finally:
            try:
                self._stack.reset(token)
            except ValueError:  # closed in another context than it opened in: drop this entry only
                self._stack.set(tuple(e for e in self._stack.get() if e is not entry))
            with self._lock:
                self._open.remove(entry)
                self._release()

    def hold(self) -> None:
        """Keep the replacements installed with no scope open (a process-wide switch, e.g. ``dcp_route.enable``);
        each ``hold`` needs one :meth:`release`."""
        with self._lock:
            self._acquire()

    def release(self) -> None:
        """Give back one :meth:`hold`."""
        with self._lock:
            if self._holds <= len(self._open):
                raise DcpS3Error(f"{self.label}: release() without hold()")
            self._release()

    # -- installing --------------------------------------------------------------------------------------------

    def _acquire(self) -> None:
        if self._holds == 0:
            self._install()
        self._holds += 1

    def _release(self) -> None:
        self._holds -= 1
        if self._holds == 0:
            self._uninstall()

    def _install(self) -> None:
        made: dict[int, Any] = {}  # one replacement per original function
        planned = []
        for site in list(self._sites()):  # may raise: nothing replaced yet
            original = site.read()
            replacement = made.get(id(original)) or made.setdefault(
                id(original), self._replacement(original, site.handler)
            )
            planned.append((site, original, replacement))
        try:
            for site, original, replacement in planned:
                site.write(replacement)
                self._replaced.append((site, original, replacement))
        except BaseException:
            self._uninstall()
            raise
        logger.debug("dcp_s3 %s: %d functions replaced", self.label, len(self._replaced))

    def _uninstall(self) -> None:
        while self._replaced:
            site, original, replacement = self._replaced.pop()
            if site.read() is replacement:
                site.write(original)
            else:  # replaced again after us: its owner puts it back
                logger.warning(
                    "dcp_s3 %s: %s.%s was replaced after dcp_s3 did; left as it is",
                    self.label,
                    getattr(site.owner, "__name__", site.owner),
                    site.name,
                )
        logger.debug("dcp_s3 %s: the framework's functions are back", self.label)

    def _replacement(self, original: Callable[..., Any], handler: Handler) -> Callable[..., Any]:
        @functools.wraps(original)
        def replaced(*args: Any, **kwargs: Any) -> Any:
            value = self.value()
            if value is None:
                return original(*args, **kwargs)
            return handler(value, original, *args, **kwargs)

        return replaced
