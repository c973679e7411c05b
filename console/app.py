"""The console's routes: read through `Reader`, act through `operators`, render with autoescaped Jinja.

Endpoints are plain functions (Starlette runs them in its thread pool) over a synchronous Redis
client: each page is a handful of pipelined reads, and an action may wait for the coordinator.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jinja2
from mcp_saga.console import views
from mcp_saga.console.auth import Credentials
from mcp_saga.runtime import operators
from mcp_saga.runtime.logs import get_logger
from mcp_saga.runtime.reader import Reader
from mcp_saga.schemas.config import ConsoleSettings
from mcp_saga.schemas.events import check_workflow_id
from mcp_saga.schemas.keys import STATUSES, Keys
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Receive, Scope, Send

HERE = Path(__file__).parent
log = get_logger("console")
# Bulk actions: retry every retryable step, approve every held one.
BULK = ("retry", "approve")
SEARCH = re.compile(r"^[A-Za-z0-9._:@-]{1,200}$")


class AuthMiddleware:
    """Every request is authenticated, except reads when `read_open`; a POST always needs a user."""

    def __init__(self, app: ASGIApp, credentials: Credentials, read_open: bool) -> None:
        self.app, self.credentials, self.read_open = app, credentials, read_open

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        user = self.credentials.authenticate(request.headers.get("authorization"))
        scope.setdefault("state", {})["user"] = user
        if user is None and (request.method not in ("GET", "HEAD") or not self.read_open):
            response = PlainTextResponse(
                "authentication required", 401, headers={"WWW-Authenticate": self.credentials.challenge()}
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class Console:
    def __init__(
        self, redis: Redis, keys: Keys, settings: ConsoleSettings, credentials: Credentials, queue: Redis | None = None
    ) -> None:
        self.redis, self.keys, self.settings, self.credentials = redis, keys, settings, credentials
        self.reader = Reader(redis, keys, queue)
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,  # every template, whatever its name: tool results and errors are untrusted
            undefined=jinja2.StrictUndefined,
        )
        self.templates = Jinja2Templates(env=env)

    # Rendering --------------------------------------------------------------------------------

    def render(self, request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
        user = request.state.user
        context |= {
            "user": user,
            "csrf": self.credentials.csrf_token(user) if user else "",
            "statuses": STATUSES,
            "poll_ms": int(self.settings.poll_seconds * 1000),
        }
        headers = {"Cache-Control": "no-store", "Content-Security-Policy": CSP, "X-Frame-Options": "DENY"}
        return self.templates.TemplateResponse(request, name, context, status_code=status_code, headers=headers)

    # Pages ------------------------------------------------------------------------------------

    def workflows(self, request: Request) -> Response:
        status = request.query_params.get("status") or None
        query = (request.query_params.get("q") or "").strip()
        page = _int(request.query_params.get("page"), 1)
        size = self.settings.page_size
        if status is not None and status not in STATUSES:
            raise HTTPException(400, f"unknown status {status[:40]!r}")
        if query and not SEARCH.fullmatch(query):
            raise HTTPException(400, "search by the start of a workflow id (letters, digits, . _ : @ -)")
        rows = self.reader.search(query, size + 1) if query else self.reader.recent(status, size + 1, (page - 1) * size)
        return self.render(
            request,
            "workflows.html",
            counts=self.reader.counts(),
            status=status,
            query=query,
            page=page,
            more=len(rows) > size,
            rows=[views.workflow_row(wf, st) for wf, st in rows[:size]],
            bulk=BULK,
        )

    def workflow(self, request: Request, message: dict[str, Any] | None = None, status_code: int = 200) -> Response:
        workflow = self._workflow_id(request)
        snapshot = self.reader.snapshot(workflow, last=self.settings.timeline_last)
        if snapshot is None:
            raise HTTPException(404, f"no workflow {workflow!r} (never seen by a coordinator, or expired)")
        return self.render(
            request,
            "workflow.html",
            status_code,
            wf=views.workflow_page(snapshot),
            mark=self.reader.mark(workflow),
            message=message,
        )

    def live(self, request: Request) -> Response:
        """The changing part of a workflow page, or 204 while the workflow is as the page shows it."""
        workflow = self._workflow_id(request)
        mark = self.reader.mark(workflow)
        if mark == request.query_params.get("mark"):
            return Response(status_code=204, headers={"Cache-Control": "no-store"})
        snapshot = self.reader.snapshot(workflow, last=self.settings.timeline_last)
        if snapshot is None:
            raise HTTPException(404, "the workflow expired")
        response = self.render(request, "_live.html", wf=views.workflow_page(snapshot), mark=mark)
        response.headers["X-Saga-Mark"] = mark
        return response

    def dead_letters(self, request: Request) -> Response:
        letters = self.reader.dead_letters(self.settings.page_size)
        return self.render(request, "dead_letters.html", letters=[views.dead_letter(d) for d in letters])

    def fleet(self, request: Request) -> Response:
        return self.render(request, "fleet.html", fleet=views.fleet(self.reader.fleet()), keys=self.keys)

    # Actions ----------------------------------------------------------------------------------

    async def act(self, request: Request) -> Response:
        form = await self._checked_form(request)
        return await run_in_threadpool(self._act, request, form)

    def _act(self, request: Request, form: FormData) -> Response:
        workflow = self._workflow_id(request)
        command = str(form.get("command", ""))
        step = str(form.get("step", "")) or None
        note = str(form.get("note", ""))
        user = request.state.user
        try:
            prepared = operators.prepare(self.reader, workflow, command, step, user, note)
            sent = operators.send(self.redis, self.keys, prepared)
            outcome = operators.await_applied(self.redis, self.keys, sent, self.settings.action_wait)
        except operators.CommandRefused as exc:
            log.info("operator command refused", workflow=workflow, step=step, command=command, by=user)
            return self.workflow(request, {"kind": "refused", "text": str(exc)}, 409)
        log.info("operator command sent", workflow=workflow, step=step, command=command, by=user, outcome=outcome)
        text = {
            "applied": f"{command} applied by {user}",
            "unchanged": f"{command} was taken but changed nothing: the records changed meanwhile",
            "pending": f"{command} sent as {sent.id}; not applied yet (is a coordinator running?)",
        }[outcome]
        if prepared.hint:
            text += f". Note: {prepared.hint}"
        return self.workflow(request, {"kind": outcome, "text": text}, 200 if outcome == "applied" else 202)

    async def bulk(self, request: Request) -> Response:
        form = await self._checked_form(request)
        return await run_in_threadpool(self._bulk, request, form)

    def _bulk(self, request: Request, form: FormData) -> Response:
        """First a confirmation page listing what each selected workflow would get; then, confirmed, send it."""
        command = str(form.get("command", ""))
        if command not in BULK:
            raise HTTPException(400, f"bulk actions: {', '.join(BULK)}")
        selected = list(dict.fromkeys(str(w) for w in form.getlist("workflow")))[: self.settings.page_size]
        if not selected:
            raise HTTPException(400, "select at least one workflow")
        user, note = request.state.user, str(form.get("note", ""))
        plans = [self._bulk_plan(workflow, command, user, note) for workflow in selected]
        if form.get("confirm") != "yes":
            return self.render(request, "confirm.html", command=command, plans=plans, note=note, done=False)
        for plan in plans:
            for prepared in plan.pop("prepared"):
                sent = operators.send(self.redis, self.keys, prepared)
                plan["sent"].append(sent.id)
            log.info("bulk operator command", workflow=plan["workflow"], command=command, by=user, sent=plan["sent"])
        return self.render(request, "confirm.html", command=command, plans=plans, note=note, done=True)

    def _bulk_plan(self, workflow: str, command: str, user: str, note: str) -> dict[str, Any]:
        plan: dict[str, Any] = {"workflow": workflow, "prepared": [], "refused": [], "sent": []}
        try:
            if command == "retry":
                plan["prepared"].append(operators.prepare(self.reader, workflow, "retry", None, user, note))
            else:
                loaded = self.reader.records(workflow)
                held = [s for s, c in (loaded[1] if loaded else {}).items() if c.status == "awaiting-approval"]
                if not held:
                    raise operators.CommandRefused(f"nothing awaits approval in {workflow!r}")
                for step in held:
                    try:
                        plan["prepared"].append(operators.prepare(self.reader, workflow, command, step, user, note))
                    except operators.CommandRefused as exc:
                        plan["refused"].append(str(exc))
        except operators.CommandRefused as exc:
            plan["refused"].append(str(exc))
        plan["targets"] = [t for p in plan["prepared"] for t in p.targets]
        return plan

    # Helpers ----------------------------------------------------------------------------------

    async def _checked_form(self, request: Request) -> FormData:
        """The form of an authenticated POST from one of our pages: CSRF token and, when sent, Origin."""
        origin = request.headers.get("origin")
        if origin and urlsplit(origin).netloc != request.headers.get("host"):
            raise HTTPException(403, "cross-origin request refused")
        form = await request.form(max_files=0, max_fields=self.settings.page_size + 10)
        token = form.get("csrf")
        if not self.credentials.csrf_valid(request.state.user, token if isinstance(token, str) else None):
            raise HTTPException(403, "missing or wrong CSRF token: reload the page and try again")
        return form

    @staticmethod
    def _workflow_id(request: Request) -> str:
        try:
            return check_workflow_id(request.path_params["workflow"])
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None


CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'"


def create_app(
    redis: Redis, keys: Keys, settings: ConsoleSettings, credentials: Credentials, *, queue: Redis | None = None
) -> Starlette:
    console = Console(redis, keys, settings, credentials, queue)

    def error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            code, text = exc.status_code, str(exc.detail)
        else:  # Redis down or timing out: a page that says so, and the process keeps serving
            log.warning("redis unavailable", error=str(exc))
            code, text = 503, f"cannot reach Redis: {exc}"
        if request.scope.get("state", {}).get("user") is None and code != 503 and not settings.read_open:
            return PlainTextResponse(text, code)
        return console.render(request, "error.html", code, code=code, text=text)

    routes = [
        Route("/", lambda request: RedirectResponse("/workflows", 302)),
        Route("/workflows", console.workflows),
        Route("/workflows/{workflow}", console.workflow),
        Route("/workflows/{workflow}/live", console.live),
        Route("/workflows/{workflow}/act", console.act, methods=["POST"]),
        Route("/bulk", console.bulk, methods=["POST"]),
        Route("/dead-letters", console.dead_letters),
        Route("/fleet", console.fleet),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    handlers: dict[Any, Any] = {
        HTTPException: error,
        RedisConnectionError: error,
        RedisTimeoutError: error,
    }
    return Starlette(
        routes=routes,
        middleware=[Middleware(AuthMiddleware, credentials=credentials, read_open=settings.read_open)],
        exception_handlers=handlers,
    )


def _int(value: str | None, default: int) -> int:
    try:
        return max(1, min(int(value or default), 10_000))
    except ValueError:
        return default
