"""The one retry policy for a database that blinks: what a connection error is, the backoff,
and how long a store call may keep trying.

A statement that fails because its connection died (a server restart, an admin shutdown, a
killed backend, a refused connect) is retried on a fresh connection, with backoff, while
the *window* lasts: for a call made by a run, the run's confirmed lease window
(:class:`~langgraph_fence.fence.RunHandle` sets it with :func:`retry_window`), so a guarded
write is repeated only while the run can still prove it holds the lease; the guard decides
again on every attempt (same checkpoint id, same token), so a repeat is safe. Outside a
run the window is :data:`DEFAULT_WINDOW` seconds. When the window runs out the last
connection error is raised: the run then stops as lease-lost and is handed back for
takeover, never ``failed``.

A SQLite write refused with "database is locked" (``SQLITE_BUSY``) is retried the same way:
the statement did not apply (in WAL mode a busy write changes nothing), and the busy timeout
already waited for the lock, unless SQLite refused at once (a connection whose read snapshot
went stale cannot wait for the write lock), where a fresh connection gets it.

Any other error (an integrity or programming error, a refused guard) is raised at once: a
retry could not change its answer. The happy path costs nothing: the window is looked at
only after a connection error.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = [
    "DEFAULT_WINDOW",
    "FixedWindow",
    "RetryWindow",
    "backoff",
    "is_connection_error",
    "is_database_connection_error",
    "is_lock_conflict",
    "retry_connection_errors",
    "retry_window",
]

logger = logging.getLogger("langgraph_fence.retry")

T = TypeVar("T")

#: Seconds a store call made outside any run keeps retrying a connection error.
DEFAULT_WINDOW = 5.0
#: The first pause after a connection error, and the longest one.
FIRST_BACKOFF = 0.05
MAX_BACKOFF = 1.0

#: What the drivers say when the connection itself is gone (lower case).
_DISCONNECT_MESSAGES = (
    "connection is closed",
    "connection was closed",
    "connection has been closed",
    # asyncpg, on a connection the server shut down while it was idle: nothing else uses
    # it, its protocol is stuck consuming the server's last error.
    "another operation",
    "terminating connection",
    "server closed the connection",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "cannot connect now",
    "connection refused",
    "connection reset",
    "connect call failed",
)
#: SQLSTATE classes and codes of a lost or refused connection: 08 (connection exception),
#: 57P01..57P03 (admin shutdown, crash shutdown, cannot connect now).
_DISCONNECT_SQLSTATES = ("57P01", "57P02", "57P03")


class RetryWindow(Protocol):
    """Until when a call may retry: ``confirmed_until`` on ``clock``; never longer than
    ``ttl`` seconds of real time (a controlled test clock may stand still)."""

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def confirmed_until(self) -> float: ...

    @property
    def ttl(self) -> float: ...


@dataclass(frozen=True, slots=True)
class FixedWindow:
    """A window of ``ttl`` seconds from its creation, on ``time.monotonic``."""

    confirmed_until: float
    ttl: float
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def lasting(cls, seconds: float) -> FixedWindow:
        """The window from now to ``seconds`` from now."""
        return cls(time.monotonic() + seconds, seconds)


_window: ContextVar[RetryWindow | None] = ContextVar("langgraph_fence_retry_window", default=None)


class retry_window:  # a function by use: ``with retry_window(handle):``
    """Store calls in the block retry connection errors while ``window`` lasts (``None``:
    the default window, unless one encloses the block).

    An enclosing window stands (the outermost caller knows best how long it may wait): a
    run's renewal made inside a wider classification window keeps the wider one. A class,
    not a generator: it is entered on every guarded write.
    """

    __slots__ = ("_token", "_window")

    def __init__(self, window: RetryWindow | None) -> None:
        self._window = window
        self._token: Token[RetryWindow | None] | None = None

    def __enter__(self) -> None:
        if self._window is not None and _window.get() is None:
            self._token = _window.set(self._window)

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _window.reset(self._token)
            self._token = None


def _sqlstate(exc: BaseException) -> str:
    code = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    return code if isinstance(code, str) else ""


def _is_disconnect(exc: BaseException) -> bool:
    # Imported here: the library runs without SQLAlchemy's asyncpg or aiosqlite extras.
    from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, ProgrammingError

    if isinstance(exc, (IntegrityError, ProgrammingError)):
        return False
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, InterfaceError):
        return True  # the DB-API's "error related to the interface": the connection
    if isinstance(exc, OSError) and not isinstance(
        exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
    ):
        return True  # refused, reset, unreachable
    kind = type(exc).__name__
    if kind in ("ConnectionDoesNotExistError", "InterfaceError", "CannotConnectNowError"):
        return True  # asyncpg's own, unwrapped (the checkpointer's raw connections)
    state = _sqlstate(exc)
    if state.startswith("08") or state in _DISCONNECT_SQLSTATES:
        return True
    if on_standby(exc):
        return True  # a standby, or no primary yet: the next connection may find it
    message = str(exc).lower()
    return any(part in message for part in _DISCONNECT_MESSAGES)


#: SQLSTATE of a write on a standby (read-only transaction), and asyncpg's word when no
#: host of a multi-host URL is the primary yet (a promotion under way).
_STANDBY_SQLSTATE = "25006"
_STANDBY_MESSAGES = ("recovery is in progress", "read-only transaction")


def on_standby(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection is to a standby, not the primary: a connection
    that landed on the wrong server, to be dropped and made again."""
    if type(exc).__name__ == "TargetServerAttributeNotMatched":
        return True
    if _sqlstate(exc) == _STANDBY_SQLSTATE:
        return True
    message = str(exc).lower()
    return any(part in message for part in _STANDBY_MESSAGES)


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or the driver error it wraps, or its cause) says the connection is
    gone or cannot be made: a retry on a fresh connection may succeed.

    A fencing error, an integrity or a programming error is never one.
    """
    from langgraph_fence.errors import ExecutionLeaseLostError

    for current in _chain(exc, wrapped=True):
        if isinstance(current, ExecutionLeaseLostError):
            return False
        if _is_disconnect(current):
            return True
    return False


def is_lock_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` (or the driver error it wraps, or its cause) is SQLite's "database is
    locked" (``SQLITE_BUSY`` and its extended codes): the write did not apply, and a repeat
    on a fresh connection may take the lock."""
    for current in _chain(exc, wrapped=True):
        name = getattr(current, "sqlite_errorname", None)
        if isinstance(name, str) and name.startswith("SQLITE_BUSY"):
            return True
        if type(current).__module__ == "sqlite3" and "database is locked" in str(current):
            return True  # Python 3.10: no error name
    return False


def _chain(exc: BaseException, *, wrapped: bool) -> Iterator[BaseException]:
    """``exc`` and the errors it links to, depth first, each once, 17 at most: its cause
    and context, and with ``wrapped`` the driver error it wraps (``orig``)."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen or len(seen) > 16:
            continue
        seen.add(id(current))
        yield current
        links: tuple[object, ...] = (current.__cause__, current.__context__)
        if wrapped:
            links = (getattr(current, "orig", None), *links)
        for inner in links:
            if isinstance(inner, BaseException):
                stack.append(inner)


#: The modules of the database drivers and of the stores: an error raised in them (or
#: passing through them) comes from a database connection, not from a node's own HTTP
#: client. (``faults``: its points stand for the store's connection in tests.)
_DATABASE_MODULES = (
    "sqlalchemy",
    "asyncpg",
    "aiosqlite",
    "sqlite3",
    # The other common drivers, and LangGraph's official savers and stores on them: a
    # node's own database client (a psycopg pool, PostgresStore) losing its connection is
    # infrastructure as much as ours.
    "psycopg",
    "psycopg2",
    "psycopg_pool",
    "pymysql",
    "aiomysql",
    "langgraph.checkpoint.postgres",
    "langgraph.checkpoint.sqlite",
    "langgraph.store.postgres",
    "langgraph.store.sqlite",
    "langgraph_fence.checkpointers",
    "langgraph_fence.database",
    "langgraph_fence.lease.sql",
    "langgraph_fence.lease.memory",
    "langgraph_fence.lease.records",
    "langgraph_fence.lease.faults",
    "langgraph_fence.sinks",
)


def _in_database_module(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in _DATABASE_MODULES)


def _from_database(exc: BaseException) -> bool:
    if _in_database_module(type(exc).__module__):
        return True
    tb = exc.__traceback__
    while tb is not None:
        if _in_database_module(str(tb.tb_frame.f_globals.get("__name__", ""))):
            return True
        tb = tb.tb_next
    return False


def is_database_connection_error(exc: BaseException) -> bool:
    """Whether ``exc``'s chain holds a connection error of a *database* connection (raised
    by, or inside, a database driver or a store): an infrastructure error. A node's
    ``ConnectionError`` from an HTTP client is the graph's own error, and is not one."""
    return any(
        is_connection_error(current) and _from_database(current)
        for current in _chain(exc, wrapped=False)
    )


def backoff(attempt: int) -> float:
    """The pause before retry ``attempt`` (0 first): doubling from FIRST_BACKOFF to
    MAX_BACKOFF, with jitter so that many workers do not reconnect in step."""
    base = min(MAX_BACKOFF, FIRST_BACKOFF * float(1 << min(attempt, 16)))
    return base * random.uniform(0.5, 1.0)


async def retry_connection_errors(operation: Callable[[], Awaitable[T]], *, what: str) -> T:
    """``await operation()``, repeated on a connection error (or a SQLite lock conflict)
    while the window lasts.

    ``operation`` must take a fresh connection each time and be safe to repeat (a guarded
    write, a read). Raises the last connection error when the window runs out, and any
    other error at once.
    """
    attempt = 0
    started = 0.0
    window: RetryWindow | None = None
    while True:
        began = time.monotonic()
        try:
            return await operation()
        except Exception as exc:
            locked = not is_connection_error(exc)
            if locked and not is_lock_conflict(exc):
                raise
            now = time.monotonic()
            if window is None:
                window = _window.get() or FixedWindow.lasting(DEFAULT_WINDOW)
                started = now
            # A run's window (its handle) keeps the error: the cause of the lease loss its
            # watchdog records if the window runs out before the store answers again.
            saw = getattr(window, "saw_store_error", None)
            if saw is not None:
                saw(exc)
            pause = backoff(attempt)
            if (
                window.clock() + pause >= window.confirmed_until
                or now + pause - started >= window.ttl
            ):
                raise
            if locked:
                # A warning, with how long SQLite kept the attempt: at once (a stale read
                # snapshot) or after the busy timeout (a writer holding the lock that long).
                logger.warning(
                    "%s: the SQLite database was locked (refused after %.3fs), retry %d in %.2fs",
                    what,
                    now - began,
                    attempt + 1,
                    pause,
                )
            else:
                logger.info(
                    "%s failed on a connection error, retry %d in %.2fs: %s",
                    what,
                    attempt + 1,
                    pause,
                    exc,
                )
            await asyncio.sleep(pause)
            attempt += 1
