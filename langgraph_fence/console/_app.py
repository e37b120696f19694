"""The console as an ASGI app (Starlette): the pages, the actions, ``/metrics``."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import inspect
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, urlencode

from jinja2 import DictLoader, Environment, select_autoescape
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from langgraph_fence.console._metrics import CONTENT_TYPE, LocalFigures, exposition
from langgraph_fence.console._queries import (
    CursorError,
    Detail,
    ExecutionRow,
    Figures,
    Filters,
    execution_detail,
    figures,
    instances,
    list_executions,
    queue,
)
from langgraph_fence.console._templates import TEMPLATES
from langgraph_fence.database import create_engine, read_only
from langgraph_fence.lease import LeaseKey, LeaseStatus
from langgraph_fence.lease.scope import parse_scope_key
from langgraph_fence.redact import failure_reason, redacted_text

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from langgraph_fence.lease.sql import SqlLeaseRepository

__all__ = ["Authorize", "CanRead", "Console", "create_app", "metrics_app"]

logger = logging.getLogger("langgraph_fence.console")

#: Who may act, as a host app tells it: the request's operator name, or ``None`` (read-only).
Authorize = Callable[[Request], "str | Awaitable[str | None] | None"]
#: Who may read, as a host app tells it.
CanRead = Callable[[Request], "bool | Awaitable[bool]"]

_COOKIE = "langgraph_fence_operator"
_NAV = (
    ("Executions", "/executions"),
    ("Dead letters", "/dead-letters"),
    ("Queue", "/queue"),
    ("Instances", "/instances"),
)
_STATUSES = [status.value for status in LeaseStatus]
#: How long /metrics reuses the database's figures, in seconds.
METRICS_MAX_AGE = 5.0
#: The largest form a page posts, in bytes (a note is at most a few hundred).
_FORM_MAX = 64 * 1024
#: The longest recorded input or config a page shows, in characters.
_SHOWN = 4_000
_WORDS = {
    "acquired": "took the lease",
    "taken_over": "took it over",
    "retaken": "took it back after a yield",
    "yielded": "yielded (waits for remote children)",
    "fenced": "write refused: a newer token holds it",
    "lost": "lost its hold",
    "dead_lettered": "dead-lettered",
    "handed_back": "handed it back",
    "retried": "retried by an operator",
    "abandoned": "abandoned by an operator",
}
_TAKES = frozenset({"acquired", "taken_over", "retaken"})
#: The turns whose detail names the holder before them: "from HOLDER at token N".
_TOLD_FROM = frozenset({"taken_over", "dead_lettered"})
_FROM = re.compile(r"\bfrom (.{1,200}?) at token (\d{1,18})\b")
_ALARMS = frozenset({"fenced", "lost", "dead_lettered"})


@dataclass(frozen=True, slots=True)
class _Item:
    token: int | None
    at: float | None
    what: str
    who: str | None
    detail: str | None
    css: str
    order: int
    first: bool = False


def _when(at: float | None) -> str:
    if at is None:
        return ""
    try:
        return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"
    except (OverflowError, OSError, ValueError):  # a time another writer got wrong
        return f"{at!r} (not a time)"


def _timeline(detail: Detail) -> list[_Item]:
    """The journal and the checkpoints' tokens, by token, each token's take first."""
    holders: dict[int, str] = {}
    for entry in detail.journal:  # who held a token before it was taken over, as told then
        said = _FROM.search(entry.detail or "") if entry.kind in _TOLD_FROM else None
        if said is not None and said.group(1) != "no holder":
            holders.setdefault(int(said.group(2)), said.group(1))
    items: list[_Item] = []
    for entry in detail.journal:
        what = _WORDS.get(entry.kind, entry.kind)
        if entry.kind in _TAKES and entry.epoch is not None and entry.holder:
            before = holders.get(entry.epoch - 1)
            if entry.kind == "acquired" and before is not None and before != entry.holder:
                what = f"took it over from {before} (a new token)"
            elif entry.kind == "taken_over" and (entry.detail or "").startswith("from no holder"):
                what = "claimed it (pending: submitted or handed back)"
            holders[entry.epoch] = entry.holder
        items.append(
            _Item(
                entry.epoch,
                entry.at,
                what,
                entry.actor or entry.holder,
                entry.detail,
                "refused" if entry.kind in _ALARMS else "",
                0 if entry.kind in _TAKES else 2,
            )
        )
    for mark in detail.checkpoints:
        steps = ""
        if mark.steps is not None:
            low, high = mark.steps
            steps = f", step {low}" if low == high else f", steps {low} to {high}"
        where = f" in subgraph {mark.checkpoint_ns}" if mark.checkpoint_ns else ""
        noun = "checkpoint" if mark.count == 1 else "checkpoints"
        items.append(
            _Item(
                mark.token,
                None,
                f"wrote {mark.count} {noun}{steps}{where}",
                None if mark.token is None else holders.get(mark.token),
                f"{mark.first_id} .. {mark.last_id}" if mark.count > 1 else mark.first_id,
                "",
                1,
            )
        )
    items.sort(key=lambda i: (-1 if i.token is None else i.token, i.order, i.at or 0.0))
    out: list[_Item] = []
    previous: int | None = -2
    for item in items:
        first = item.token != previous
        previous = item.token
        out.append(replace(item, first=True) if first else item)
    return out


class Console:
    """The console's state: its database, its scope and who may act.

    Args:
        db: a database URL (as :meth:`~langgraph_fence.Instance.open` takes) or an engine.
        schema: PostgreSQL schema of the tables (with a URL).
        tenant: show this tenant only (every page and ``/metrics``).
        operator_token: the secret that unlocks the actions for whoever signs in with it
            (and a name the journal records); ``None``: read-only, unless ``authorize``.
        authorize: the host app's word on who acts (see :func:`create_app`); replaces the
            token sign-in.
        local: a worker's own figures for ``/metrics`` (``langgraph-fence worker
            --metrics-port``).
        metrics_max_age: how long scrapes of ``/metrics`` share the database's figures,
            in seconds (0: read at every scrape).
        can_read: the host app's word on who may read at all (``False``: 403 for every
            page and ``/metrics``); ``None``: whoever reaches it.
        secret: what signs the sign-in cookie and the forms (at least 16 characters): give
            the same to every replica behind one address (default: the operator token, or
            a random one per process).
    """

    def __init__(
        self,
        db: str | AsyncEngine,
        *,
        schema: str | None = None,
        tenant: str | None = None,
        operator_token: str | None = None,
        authorize: Authorize | None = None,
        local: Callable[[], Sequence[LocalFigures]] | None = None,
        metrics_max_age: float = METRICS_MAX_AGE,
        can_read: CanRead | None = None,
        secret: str | None = None,
    ) -> None:
        if can_read is not None and not callable(can_read):
            raise ValueError("can_read must be a callable taking the request")
        self._can_read = can_read
        if secret is not None and len(secret) < 16:
            raise ValueError("secret must be at least 16 characters")
        if not isinstance(metrics_max_age, int | float) or metrics_max_age < 0:
            raise ValueError(
                f"metrics_max_age must be seconds >= 0 (0: read at every scrape), "
                f"got {metrics_max_age!r}"
            )
        self.metrics_max_age = float(metrics_max_age)
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError("tenant must be a non-empty tenant id, or None for every tenant")
        if operator_token is not None and len(operator_token) < 16:
            raise ValueError(
                "operator_token must be at least 16 characters (it unlocks retrying and "
                "abandoning dead letters): make one with `python -c 'import secrets; "
                "print(secrets.token_urlsafe())'`"
            )
        if authorize is not None and not callable(authorize):
            raise ValueError("authorize must be a callable taking the request")
        self._db = db
        self._schema = schema
        self.tenant = tenant
        self._token = operator_token
        self._authorize = authorize
        self._local = local
        self._engine: AsyncEngine | None = None if isinstance(db, str) else db
        self._owns_engine = isinstance(db, str)
        self._repository: SqlLeaseRepository | None = None
        self._lock = asyncio.Lock()
        # Signs the sign-in cookie and the forms' anti-forgery field: the same in every
        # replica and across restarts when given (or the operator token is), else this
        # process's own.
        self._secret = (secret or operator_token or secrets.token_urlsafe(32)).encode()
        self._env = Environment(
            loader=DictLoader(TEMPLATES),
            autoescape=select_autoescape(default=True, default_for_string=True),
        )
        self._env.filters["when"] = _when
        self._env.filters["keypath"] = lambda key: quote(str(key), safe="")

    @property
    def can_act(self) -> bool:
        """Whether any request may act (an operator token or ``authorize`` was given)."""
        return self._token is not None or self._authorize is not None

    async def engine(self) -> AsyncEngine:
        """The engine the console reads through (made from the URL at first use)."""
        if self._engine is None:
            async with self._lock:
                if self._engine is None:
                    assert isinstance(self._db, str)
                    self._engine = create_engine(self._db, schema=self._schema)
        return self._engine

    async def repository(self) -> SqlLeaseRepository:
        """The lease store on :meth:`engine`, made once (its clock; the resolve actions).
        One per console: a lease store on PostgreSQL opens a pool of its own."""
        if self._repository is None:
            from langgraph_fence.lease.sql import SqlLeaseRepository

            engine = await self.engine()
            async with self._lock:
                if self._repository is None:
                    self._repository = SqlLeaseRepository(engine)
        return self._repository

    async def aclose(self) -> None:
        """Close the engine the console made (never one it was given)."""
        if self._owns_engine and self._engine is not None:
            await self._engine.dispose()
            self._engine = None

    # -- who acts

    def _sign(self, what: str) -> str:
        return hmac.new(self._secret, what.encode(), hashlib.sha256).hexdigest()

    async def actor(self, request: Request) -> str | None:
        """The operator acting through ``request``, or ``None`` (read-only)."""
        if self._authorize is not None:
            said = self._authorize(request)
            if inspect.isawaitable(said):
                said = await said
            return said if isinstance(said, str) and said else None
        if self._token is None:
            return None
        cookie = request.cookies.get(_COOKIE)
        if not cookie:
            return None
        try:
            name, signature = base64.urlsafe_b64decode(cookie.encode()).decode().rsplit("\n", 1)
        except Exception:
            return None
        return name if hmac.compare_digest(signature, self._sign("operator:" + name)) else None

    def csrf(self, actor: str | None) -> str:
        """The anti-forgery value a form of ``actor``'s carries."""
        return "" if actor is None else self._sign("csrf:" + actor)

    # -- rendering

    def render(
        self,
        request: Request,
        template: str,
        actor: str | None,
        here: str = "",
        status_code: int = 200,
        **values: Any,
    ) -> HTMLResponse:
        page = self._env.get_template(template).render(
            base=request.scope.get("root_path", "").rstrip("/"),
            nav=_NAV,
            here=here,
            actor=actor,
            csrf=self.csrf(actor),
            token_login=self._authorize is None,
            can_sign_in=self._token is not None and self._authorize is None,
            scope_tenant=self.tenant,
            **values,
        )
        return HTMLResponse(
            page,
            status_code=status_code,
            headers={
                # Pages are rendered here, whole: no script, no frame, no outside resource.
                "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
                "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "same-origin",
                "Cache-Control": "no-store",
            },
        )


def create_app(
    db: str | AsyncEngine,
    *,
    schema: str | None = None,
    tenant: str | None = None,
    operator_token: str | None = None,
    authorize: Authorize | None = None,
    local: Callable[[], Sequence[LocalFigures]] | None = None,
    metrics_max_age: float = METRICS_MAX_AGE,
    can_read: CanRead | None = None,
    secret: str | None = None,
) -> Starlette:
    """The operator's console on ``db``, as an ASGI app to serve or mount.

    Pages: executions (filtered, paginated, newest change first), one execution (its
    lease on the store's clock, its stamps, its token timeline, its children, its recorded
    input and config), dead letters, the run queue, the serving instances; and
    ``/metrics`` in Prometheus' format.

    Read-only unless ``operator_token`` is given (whoever signs in with it may retry or
    abandon a dead letter, under the rules of ``langgraph-fence resolve``; each action is
    journaled with their name and note) or ``authorize`` (a callable taking the request
    and returning the operator's name, or ``None`` for read-only: the host app's own
    authentication, when the console is mounted in it). Every value shown is escaped.

    Args:
        db: a database URL or an engine (an engine given is never disposed of here).
        schema: PostgreSQL schema of the tables, with a URL.
        tenant: show this tenant only.
        operator_token: the operator's secret (at least 16 characters).
        authorize: the host app's authorization; replaces the token sign-in.
        local: a worker's own figures for ``/metrics``.
        metrics_max_age: how long scrapes share the database's figures, in seconds (each
            read scans the lease table: a few hundred milliseconds at 100 000 executions).
        can_read: the host app's word on who may read at all (``False``: 403); ``None``:
            whoever reaches the console reads every execution it shows, recorded input
            included, so bind it to loopback or put it behind your authentication.
        secret: what signs the sign-in cookie and the forms; the same for every replica.
    """
    console = Console(
        db,
        schema=schema,
        tenant=tenant,
        operator_token=operator_token,
        authorize=authorize,
        local=local,
        metrics_max_age=metrics_max_age,
        can_read=can_read,
        secret=secret,
    )
    handlers = _Handlers(console)
    app = Starlette(
        middleware=[Middleware(_ReadGate, console=console)],
        routes=[
            Route("/", handlers.home),
            Route("/executions", handlers.executions),
            Route("/executions/{key:path}", handlers.execution),
            Route("/dead-letters", handlers.dead_letters),
            Route("/queue", handlers.queue),
            Route("/instances", handlers.instances),
            Route("/metrics", handlers.metrics),
            Route("/resolve", handlers.resolve, methods=["POST"]),
            Route("/login", handlers.login, methods=["GET", "POST"]),
            Route("/logout", handlers.logout, methods=["POST"]),
        ],
        exception_handlers={
            _BadInput: handlers.failed,
            SQLAlchemyError: handlers.failed,
            OSError: handlers.failed,
        },
    )
    app.state.console = console
    return app


class _BadInput(ValueError):
    pass


class _Handlers:
    def __init__(self, console: Console) -> None:
        self.c = console
        self._figures: tuple[float, Figures] | None = None
        self._figures_lock = asyncio.Lock()

    def _base(self, request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    async def _now(self) -> float:
        """The store's clock (every expiry is in it)."""
        return await (await self.c.repository()).now()

    def _filters(self, request: Request, status: str | None = None) -> Filters:
        q = request.query_params

        def one(name: str) -> str | None:
            value = q.get(name, "").strip()
            return value or None

        wanted = status or one("status")
        if wanted is not None and wanted not in _STATUSES:
            raise _BadInput(f"status must be one of {', '.join(_STATUSES)}, got {wanted!r}")
        tenant = self.c.tenant if self.c.tenant is not None else one("tenant")
        return Filters(tenant=tenant, status=wanted, graph=one("graph"), holder=one("holder"))

    async def home(self, request: Request) -> Response:
        return RedirectResponse(self._base(request) + "/executions", status_code=303)

    async def _listing(
        self, request: Request, filters: Filters
    ) -> tuple[list[ExecutionRow], str | None]:
        engine = await self.c.engine()
        after = request.query_params.get("after") or None
        now = await self._now()
        try:
            async with read_only(engine).connect() as conn:
                rows, following = await list_executions(conn, filters, now, after=after)
        except CursorError as exc:
            raise _BadInput(f"after: {exc}") from None
        if following is None:
            return rows, None
        kept = {k: v for k, v in request.query_params.items() if k != "after" and v}
        return rows, urlencode({**kept, "after": following})

    async def executions(self, request: Request) -> Response:
        actor = await self.c.actor(request)
        filters = self._filters(request)
        rows, following = await self._listing(request, filters)
        return self.c.render(
            request,
            "executions.html",
            actor,
            "/executions",
            rows=rows,
            following=following,
            filters=filters,
            statuses=_STATUSES,
        )

    async def dead_letters(self, request: Request) -> Response:
        actor = await self.c.actor(request)
        filters = self._filters(request, status=LeaseStatus.DEAD_LETTERED.value)
        rows, following = await self._listing(request, filters)
        return self.c.render(
            request,
            "dead_letters.html",
            actor,
            "/dead-letters",
            rows=rows,
            following=following,
            flash=_flash(request),
        )

    def _key(self, raw: str) -> LeaseKey | None:
        try:
            parts = parse_scope_key(raw)
            if len(parts) != 2:
                return None
            key = LeaseKey(parts[0], parts[1])
        except ValueError:  # not a scope key, or not an id a lease can have
            return None
        if self.c.tenant is not None and key.tenant_id != self.c.tenant:
            return None  # outside the console's scope: as if it did not exist
        return key

    async def execution(self, request: Request) -> Response:
        actor = await self.c.actor(request)
        key = self._key(request.path_params["key"])
        engine = await self.c.engine()
        detail = None
        if key is not None:
            now = await self._now()
            async with read_only(engine).connect() as conn:
                detail = await execution_detail(conn, key, now)
        if key is None or detail is None:
            return self.c.render(
                request,
                "problem.html",
                actor,
                status_code=404,
                title="No such execution",
                error="No execution has this key (in this console's tenant).",
            )
        input_text, config_text = await _recorded(engine, key)
        return self.c.render(
            request,
            "execution.html",
            actor,
            d=detail,
            timeline=_timeline(detail),
            parent_key=None if detail.parent is None else detail.parent.scope_key,
            input_text=input_text,
            config_text=config_text,
            flash=_flash(request),
        )

    async def queue(self, request: Request) -> Response:
        from langgraph_fence.queue import served_graphs

        actor = await self.c.actor(request)
        engine = await self.c.engine()
        async with read_only(engine).connect() as conn:
            rows = await queue(conn, self.c.tenant)
        served = await served_graphs(read_only(engine))
        return self.c.render(request, "queue.html", actor, "/queue", rows=rows, served=served)

    async def instances(self, request: Request) -> Response:
        actor = await self.c.actor(request)
        engine = await self.c.engine()
        async with read_only(engine).connect() as conn:
            rows = await instances(conn, self.c.tenant)
        return self.c.render(request, "instances.html", actor, "/instances", rows=rows)

    async def metrics(self, request: Request) -> Response:
        """The exposition; the database's figures read at most every ``metrics_max_age``
        seconds (scrapes in between share them)."""
        async with self._figures_lock:
            now = time.monotonic()
            if self._figures is None or now - self._figures[0] >= self.c.metrics_max_age:
                engine = await self.c.engine()
                async with read_only(engine).connect() as conn:
                    self._figures = (now, await figures(conn, self.c.tenant))
            found = self._figures[1]
        local = self.c._local() if self.c._local is not None else ()
        return Response(exposition(found, local), media_type=CONTENT_TYPE)

    async def _form(self, request: Request) -> dict[str, str]:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > _FORM_MAX:
                raise _BadInput("the form is too large")
        parsed = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        return {name: values[0] for name, values in parsed.items()}

    async def resolve(self, request: Request) -> Response:
        from langgraph_fence.lease.journal import resolve

        actor = await self.c.actor(request)
        if actor is None:
            return self.c.render(
                request,
                "problem.html",
                None,
                status_code=403,
                title="Read-only",
                error="This console is read-only"
                + (
                    " until you sign in."
                    if self.c.can_act
                    else ": it was started without an operator token (LANGGRAPH_FENCE_UI_TOKEN)."
                ),
            )
        form = await self._form(request)
        if not hmac.compare_digest(form.get("csrf", ""), self.c.csrf(actor)):
            return self.c.render(
                request,
                "problem.html",
                actor,
                status_code=403,
                title="Refused",
                error="The form did not come from this console's page: open the page again.",
            )
        key = self._key(form.get("key", ""))
        action = form.get("action")
        if key is None:
            raise _BadInput("key: no execution of this console has this key")
        if action not in ("retry", "abandon"):
            raise _BadInput("action must be retry or abandon")
        note = form.get("note", "").strip() or None
        repository = await self.c.repository()
        back = f"{self._base(request)}/executions/{quote(key.scope_key, safe='')}"
        try:
            await resolve(repository, key, abandon=action == "abandon", note=note, actor=actor)
        except KeyError:
            raise _BadInput("key: no such execution") from None
        except ValueError as exc:
            return self.c.render(
                request,
                "problem.html",
                actor,
                status_code=409,
                title="Not resolved",
                error=f"{key.scope_key}: {exc}",
            )
        done = "abandoned" if action == "abandon" else "retried"
        return RedirectResponse(f"{back}?resolved={done}", status_code=303)

    async def login(self, request: Request) -> Response:
        if self.c._token is None or self.c._authorize is not None:
            return self.c.render(
                request,
                "problem.html",
                None,
                status_code=404,
                title="No sign-in here",
                error="This console was started without an operator token: it is read-only.",
            )
        if request.method == "GET":
            return self.c.render(request, "login.html", None)
        form = await self._form(request)
        name = " ".join(form.get("name", "").split())[:100]
        if not name or not hmac.compare_digest(
            form.get("token", "").encode(), self.c._token.encode()
        ):
            return self.c.render(
                request,
                "login.html",
                None,
                status_code=403,
                error="Wrong token, or no name given.",
            )
        value = base64.urlsafe_b64encode(
            f"{name}\n{self.c._sign('operator:' + name)}".encode()
        ).decode()
        response = RedirectResponse(self._base(request) + "/dead-letters", status_code=303)
        response.set_cookie(
            _COOKIE,
            value,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path=(self._base(request) or "/"),
        )
        return response

    async def logout(self, request: Request) -> Response:
        actor = await self.c.actor(request)
        form = await self._form(request)
        response = RedirectResponse(self._base(request) + "/executions", status_code=303)
        if actor is not None and hmac.compare_digest(form.get("csrf", ""), self.c.csrf(actor)):
            response.delete_cookie(_COOKIE, path=(self._base(request) or "/"))
        return response

    async def failed(self, request: Request, exc: Exception) -> Response:
        """A bad request (400), or the database failed (503): one line saying which."""
        if isinstance(exc, _BadInput):
            return self.c.render(
                request, "problem.html", None, status_code=400, title="Bad request", error=str(exc)
            )
        logger.warning("console: %s failed: %s", request.url.path, failure_reason(exc))
        return self.c.render(
            request,
            "problem.html",
            None,
            status_code=503,
            title="The database failed",
            error=f"{failure_reason(exc)} (if the database was never migrated to this "
            "version: langgraph-fence migrate --db URL)",
        )


class _ReadGate:
    """Refuses every request the host app's ``can_read`` refuses (403)."""

    def __init__(self, app: Any, console: Console) -> None:
        self.app = app
        self.console = console

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        check = self.console._can_read
        if scope["type"] != "http" or check is None:
            await self.app(scope, receive, send)
            return
        allowed = check(Request(scope, receive))
        if inspect.isawaitable(allowed):
            allowed = await allowed
        if allowed is True:
            await self.app(scope, receive, send)
            return
        response = Response("not allowed to read this console\n", status_code=403)
        await response(scope, receive, send)


def metrics_app(
    db: str | AsyncEngine,
    *,
    schema: str | None = None,
    tenant: str | None = None,
    local: Callable[[], Sequence[LocalFigures]] | None = None,
    metrics_max_age: float = METRICS_MAX_AGE,
) -> Starlette:
    """``/metrics`` alone, as an ASGI app: what a worker serves on ``--metrics-port``
    (figures, never an execution's page, input or reason)."""
    console = Console(
        db, schema=schema, tenant=tenant, local=local, metrics_max_age=metrics_max_age
    )
    handlers = _Handlers(console)
    app = Starlette(
        routes=[Route("/metrics", handlers.metrics)],
        exception_handlers={SQLAlchemyError: handlers.failed, OSError: handlers.failed},
    )
    app.state.console = console
    return app


def _flash(request: Request) -> str | None:
    done = request.query_params.get("resolved")
    if done == "retried":
        return "Retried: pending again at the next token; a worker serving its graph takes it."
    if done == "abandoned":
        return "Abandoned: failed with your note, its stamps cleared; nothing runs it again."
    return None


async def _recorded(engine: AsyncEngine, key: LeaseKey) -> tuple[str, str]:
    """The recorded input and run config of ``key``, as text an operator may see."""
    from langgraph_fence.lease.records import SqlExecutionRecords

    try:
        record = await SqlExecutionRecords(read_only(engine)).get(key)
    except ValueError as exc:
        said = f"(cannot be shown: {failure_reason(exc)})"
        return said, said
    if record is None:
        return "(no record)", "(no record)"

    def text_of(value: Any) -> str:
        try:
            shown = json.dumps(value, indent=2, default=repr, ensure_ascii=False)
        except (TypeError, ValueError):
            shown = repr(value)
        return redacted_text(shown, limit=_SHOWN)

    return text_of(record.input), text_of(record.run.as_payload())
