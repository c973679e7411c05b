"""The web console's routes with Starlette's TestClient, over a real Redis and the real coordinator in-process.

What is checked is what an operator relies on: nothing is shown or done without credentials, a form
posted from elsewhere (no or a wrong CSRF token, another origin) changes nothing, untrusted text is
rendered as text, refusals are shown with the same reasons as `saga`, and an action is the same
operator event the CLI sends, applied by the coordinator, with the signed-in user as `by`.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from collections.abc import Iterator

import pytest
import redis
from mcp_saga.console import Credentials, create_app, views
from mcp_saga.console.auth import CredentialsError
from mcp_saga.coordinator.consumer import Coordinator
from mcp_saga.runtime.reader import Reader
from mcp_saga.schemas.config import ConfigError, ConsoleSettings, parse_config
from mcp_saga.schemas.events import CompensationFailed, CompensationRefused, StepCompleted
from starlette.testclient import TestClient
from test_ops_cli import KEYS, charge, comp, failed, publish, pump, reserve, timeline

TOKEN = "t0ken-for-the-console-tests"
USERS = {"alice": "wonderland", "bob": "builder"}
XSS = "<script>alert('xss')</script>"


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


ALICE = basic("alice", "wonderland")


@pytest.fixture
def coord(r: redis.Redis) -> Coordinator:
    coordinator = Coordinator(r, parse_config({"coordinator": {"block_ms": 10}}), name="test")
    coordinator.ensure_group()
    return coordinator


@pytest.fixture
def stuck(r: redis.Redis, coord: Coordinator) -> str:
    """order-1 needs attention: refunding the charge failed for good with an error holding markup."""
    hostile = StepCompleted(
        step="charge",
        server="payments",
        tool="charge_payment",
        arguments={"orderId": XSS},
        result={"structuredContent": {"tx": "T-1", "orderId": XSS}},
        recovery=charge().recovery,
    )
    publish(r, "order-1", reserve(), hostile, failed())
    pump(coord)
    publish(r, "order-1", CompensationFailed(step="charge", dispatch=1, attempt=1, error=f"boom {XSS}", duration_ms=42))
    pump(coord)
    return "order-1"


def client(r: redis.Redis, **settings: object) -> TestClient:
    credentials = Credentials(token=TOKEN, users=USERS)
    return TestClient(create_app(r, KEYS, ConsoleSettings(**settings), credentials))  # type: ignore[arg-type]


@pytest.fixture
def web(r: redis.Redis) -> TestClient:
    return client(r, action_wait=0)


def csrf(page: str) -> str:
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert match, "the page has a form with a CSRF token"
    return match.group(1)


@pytest.fixture
def coordinator_running(coord: Coordinator) -> Iterator[None]:
    """The coordinator consuming in the background, so an action can wait until it is applied."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            coord.step()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(5)


PAGES = [
    "/workflows",
    "/workflows?status=needs-attention",
    "/workflows/order-1",
    "/workflows/order-1/live",
    "/dead-letters",
    "/fleet",
    "/static/console.css",
]


# Authentication -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PAGES)
def test_every_page_needs_credentials(web: TestClient, stuck: str, path: str) -> None:
    for headers in ({}, basic("alice", "wrong"), basic("mallory", "wonderland"), {"Authorization": "Bearer nope"}):
        response = web.get(path, headers=headers)
        assert response.status_code == 401, headers
        assert response.headers["WWW-Authenticate"].startswith("Basic")
        assert "order-1" not in response.text
    assert web.get(path, headers=ALICE).status_code == 200
    assert web.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_actions_need_credentials_even_when_reading_is_open(r: redis.Redis, stuck: str) -> None:
    web = client(r, read_open=True, action_wait=0)
    page = web.get("/workflows/order-1")
    assert page.status_code == 200 and "read-only (not signed in)" in page.text
    assert 'action="/workflows/order-1/act"' not in page.text  # no forms without a user
    events = r.xlen(KEYS.events)
    for path in ("/workflows/order-1/act", "/bulk"):
        response = web.post(path, data={"command": "retry", "step": "charge", "workflow": "order-1", "csrf": "x"})
        assert response.status_code == 401
    assert r.xlen(KEYS.events) == events


# CSRF ------------------------------------------------------------------------------------------


def test_posts_without_the_right_csrf_token_change_nothing(web: TestClient, r: redis.Redis, stuck: str) -> None:
    bobs = csrf(web.get("/workflows/order-1", headers=basic("bob", "builder")).text)
    alices = csrf(web.get("/workflows/order-1", headers=ALICE).text)
    assert bobs != alices
    events = r.xlen(KEYS.events)
    form = {"command": "retry", "step": "charge"}
    for token in (None, "", "0" * 64, bobs):
        data = form if token is None else {**form, "csrf": token}
        response = web.post("/workflows/order-1/act", data=data, headers=ALICE)
        assert response.status_code == 403 and "CSRF" in response.text
        bulk = web.post("/bulk", data={**data, "workflow": "order-1", "confirm": "yes"}, headers=ALICE)
        assert bulk.status_code == 403
    cross = web.post(
        "/workflows/order-1/act", data={**form, "csrf": alices}, headers={**ALICE, "Origin": "http://evil.example"}
    )
    assert cross.status_code == 403 and "cross-origin" in cross.text
    assert r.xlen(KEYS.events) == events


# Escaping --------------------------------------------------------------------------------------


def test_tool_results_and_errors_render_as_text(web: TestClient, stuck: str) -> None:
    for path in ("/workflows/order-1", "/workflows/order-1/live"):
        page = web.get(path, headers=ALICE).text
        assert "<script>alert" not in page
        assert "&lt;script&gt;alert(&#39;xss&#39;)&lt;/script&gt;" in page  # the result, the arguments, the error
        assert "boom &lt;script&gt;" in page


def test_dead_letter_reasons_and_data_are_escaped(web: TestClient, r: redis.Redis, coord: Coordinator) -> None:
    r.xadd(KEYS.events, {"type": "step-completed", "workflow": "order-5", "data": f'{{"step": "{XSS}"'})
    pump(coord)
    page = web.get("/dead-letters", headers=ALICE).text
    assert "order-5" in page and "step-completed data: Expected `str` matching regex" in page
    assert "<script>" not in page and "&lt;script&gt;" in page


# Refusals and actions --------------------------------------------------------------------------


def test_refusals_are_shown_with_the_cli_reasons_and_nothing_is_sent(
    web: TestClient, r: redis.Redis, stuck: str
) -> None:
    token = csrf(web.get("/workflows/order-1", headers=ALICE).text)
    events = r.xlen(KEYS.events)
    cases = [
        ({"command": "retry", "step": "reserve"}, "step &#39;reserve&#39; is pending"),
        ({"command": "skip", "step": "nope"}, "has no step &#39;nope&#39;"),
        ({"command": "resolve", "step": "charge", "note": "x" * 9000}, "the note is 9000 characters"),
        ({"command": "dance", "step": "charge"}, "unknown command"),
        ({"command": "resolve", "step": "charge", "note": " "}, "resolve needs a note"),
    ]
    for form, reason in cases:
        response = web.post("/workflows/order-1/act", data={**form, "csrf": token}, headers=ALICE)
        assert response.status_code == 409, form
        assert reason in response.text, form
        assert 'class="message refused"' in response.text
    assert r.xlen(KEYS.events) == events


def test_an_action_is_the_cli_event_by_the_signed_in_user(
    web: TestClient, r: redis.Redis, stuck: str, coordinator_running: None
) -> None:
    web = client(r, action_wait=10)
    token = csrf(web.get("/workflows/order-1", headers=ALICE).text)
    response = web.post(
        "/workflows/order-1/act",
        data={"command": "retry", "step": "charge", "note": "processor is back", "csrf": token},
        headers=ALICE,
    )
    assert response.status_code == 200, response.text
    assert "retry applied by alice" in response.text
    [(_, fields)] = r.xrevrange(KEYS.events, count=1)
    assert fields[b"type"] == b"operator-retry"  # the CLI's event, as `saga retry --step charge` sends it
    assert json.loads(fields[b"data"]) == {"step": "charge", "by": "alice", "note": "processor is back"}
    entry = next(e for e in timeline(r, stuck) if e["type"] == "operator-retry")
    assert (entry["by"], entry["note"]) == ("alice", "processor is back")
    assert comp(r, stuck, "charge").dispatch == 2
    assert ">alice<" in response.text  # who did it, on the page's timeline


def test_bulk_retry_asks_for_confirmation_then_sends_one_event_per_workflow(
    web: TestClient, r: redis.Redis, coord: Coordinator, stuck: str
) -> None:
    publish(r, "order-2", reserve(), failed(1))  # compensating: nothing to retry
    pump(coord)
    token = csrf(web.get("/workflows", headers=ALICE).text)
    events = r.xlen(KEYS.events)
    form = {"command": "retry", "workflow": ["order-1", "order-2"], "csrf": token, "note": "bulk"}
    confirm = web.post("/bulk", data=form, headers=ALICE)
    assert confirm.status_code == 200
    assert "confirm: retry in 2 workflow(s)" in confirm.text
    assert "nothing to retry in &#39;order-2&#39;" in confirm.text
    assert "yes, retry 1 step(s)" in confirm.text
    assert r.xlen(KEYS.events) == events  # the confirmation page sends nothing

    done = web.post("/bulk", data={**form, "confirm": "yes"}, headers=ALICE)
    assert done.status_code == 200 and "sent: retry" in done.text
    assert r.xlen(KEYS.events) == events + 1
    [(_, fields)] = r.xrevrange(KEYS.events, count=1)
    assert (fields[b"workflow"], fields[b"type"]) == (b"order-1", b"operator-retry")
    assert json.loads(fields[b"data"])["by"] == "alice"


def test_bulk_approve_approves_every_held_step(web: TestClient, r: redis.Redis, coord: Coordinator) -> None:
    publish(r, "order-3", reserve(), charge(), failed())
    pump(coord)
    publish(
        r,
        "order-3",
        CompensationRefused(
            step="charge",
            dispatch=1,
            attempt=1,
            status="awaiting-approval",
            reason="policy requires approval for payments:refund_payment",
        ),
    )
    pump(coord)
    token = csrf(web.get("/workflows", headers=ALICE).text)
    form = {"command": "approve", "workflow": ["order-3"], "csrf": token, "confirm": "yes"}
    assert web.post("/bulk", data=form, headers=ALICE).status_code == 200
    [(_, fields)] = r.xrevrange(KEYS.events, count=1)
    assert fields[b"type"] == b"operator-approve" and json.loads(fields[b"data"])["step"] == "charge"
    pump(coord)
    assert comp(r, "order-3", "charge").approved


# Live updates, lists, search --------------------------------------------------------------------


def test_live_fragment_is_204_until_the_workflow_changes(
    web: TestClient, r: redis.Redis, coord: Coordinator, stuck: str
) -> None:
    page = web.get("/workflows/order-1", headers=ALICE).text
    mark = re.search(r'data-mark="([^"]+)"', page).group(1)  # type: ignore[union-attr]
    assert web.get(f"/workflows/order-1/live?mark={mark}", headers=ALICE).status_code == 204
    token = csrf(page)
    web.post("/workflows/order-1/act", data={"command": "skip", "step": "charge", "csrf": token}, headers=ALICE)
    pump(coord)
    changed = web.get(f"/workflows/order-1/live?mark={mark}", headers=ALICE)
    assert changed.status_code == 200
    assert changed.headers["X-Saga-Mark"] != mark
    assert "operator-skip" in changed.text and "<html" not in changed.text


def test_list_counts_search_and_pages(web: TestClient, r: redis.Redis, coord: Coordinator) -> None:
    for n in range(5):
        publish(r, f"shop-{n}", reserve())
    publish(r, "other-1", reserve())
    pump(coord)
    web = client(r, page_size=2)
    page = web.get("/workflows", headers=ALICE).text
    assert re.search(r"<b>6</b> running", page) and "older →" in page
    second = web.get("/workflows?page=2", headers=ALICE).text
    third = web.get("/workflows?page=3", headers=ALICE).text
    shown = [set(re.findall(r">((?:shop|other)-\d)</a>", p)) for p in (page, second, third)]
    assert set().union(*shown) == {f"shop-{n}" for n in range(5)} | {"other-1"}
    assert sum(map(len, shown)) == 6
    found = web.get("/workflows?q=other", headers=ALICE).text
    assert "other-1" in found and "shop-" not in found.split("<tbody>")[1]
    assert web.get("/workflows?q=%3Cb%3E", headers=ALICE).status_code == 400
    assert web.get("/workflows?status=bogus", headers=ALICE).status_code == 400


def test_reader_search_treats_glob_characters_literally(r: redis.Redis, coord: Coordinator) -> None:
    publish(r, "a.b-1", reserve())
    publish(r, "axb-2", reserve())
    pump(coord)
    reader = Reader(r, KEYS)
    assert [w for w, _ in reader.search("a.")] == ["a.b-1"]
    assert reader.search("a*") == [] and reader.search("[a]") == []


def test_fleet_shows_coordinators_and_queue(web: TestClient, stuck: str) -> None:
    page = web.get("/fleet", headers=ALICE).text
    assert ">test<" in page  # the in-process coordinator, a consumer of the group
    assert "queued" in page and "no worker is registered" in page


def test_unknown_and_invalid_workflows(web: TestClient) -> None:
    assert web.get("/workflows/nope", headers=ALICE).status_code == 404
    bad = web.get("/workflows/%3Cscript%3E", headers=ALICE)
    assert bad.status_code == 400 and "<script>" not in bad.text


def test_unreachable_redis_is_a_503_page_not_a_crash() -> None:
    down = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    web = TestClient(create_app(down, KEYS, ConsoleSettings(), Credentials(users=USERS)))
    response = web.get("/workflows", headers=ALICE)
    assert response.status_code == 503 and "cannot reach Redis" in response.text


# The picture ------------------------------------------------------------------------------------


def test_attempts_are_bars_as_long_as_the_worker_measured(r: redis.Redis, stuck: str) -> None:
    snapshot = Reader(r, KEYS).snapshot(stuck)
    assert snapshot is not None
    picture = views.picture(snapshot)
    lanes = {lane["name"]: lane for lane in picture["lanes"]}
    assert list(lanes) == ["workflow", "undo charge", "undo reserve"]
    assert [p["kind"] for p in lanes["workflow"]["parts"]] == ["status", "failure"]  # the failure drawn on top
    assert lanes["workflow"]["parts"][0]["label"] == "status: needs-attention"
    [dispatched, attempt] = lanes["undo charge"]["parts"]
    assert dispatched["w"] == 0 and "compensation-dispatched" in dispatched["label"]
    assert attempt["kind"] == "failed" and attempt["w"] >= 3 and "after 42 ms" in attempt["label"]


# Configuration and credentials ------------------------------------------------------------------


def test_console_settings_are_validated() -> None:
    assert parse_config({}).console.host == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"console.port: "):
        parse_config({"console": {"port": 70000}})
    with pytest.raises(ConfigError, match=r"console.token: unknown field"):
        parse_config({"console": {"token": "secrets stay in the environment"}})


def test_credentials_from_the_environment() -> None:
    creds = Credentials.from_env({"SAGA_CONSOLE_USERS": "alice:a:b, bob:pw", "SAGA_CONSOLE_TOKEN": TOKEN})
    assert creds.users == {"alice": "a:b", "bob": "pw"} and creds.token == TOKEN
    assert creds.authenticate(basic("alice", "a:b")["Authorization"]) == "alice"
    assert creds.authenticate("Basic !!!") is None
    with pytest.raises(CredentialsError, match="SAGA_CONSOLE_USERS"):
        Credentials.from_env({"SAGA_CONSOLE_USERS": "alice"})
    with pytest.raises(CredentialsError, match="at least 16"):
        Credentials.from_env({"SAGA_CONSOLE_TOKEN": "short"})
    assert not Credentials.from_env({}).configured


def test_saga_console_refuses_to_start_without_credentials_or_with_a_bad_port(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    from mcp_saga.cli.main import main

    for name in ("SAGA_CONSOLE_TOKEN", "SAGA_CONSOLE_USERS", "SAGA_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert main(["console", "--redis", redis_url]) == 2
    assert "no credentials: set SAGA_CONSOLE_TOKEN" in capsys.readouterr().err
    monkeypatch.setenv("SAGA_CONSOLE_TOKEN", TOKEN)
    assert main(["console", "--redis", redis_url, "--port", "70000"]) == 2
    assert "saga console: --port: Input should be less than or equal to 65535" in capsys.readouterr().err
