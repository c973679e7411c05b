"""The console in a real browser (headless Debian chromium, driven by Selenium) against a real run.

Real processes throughout: the three example MCP servers over streamable HTTP, a coordinator, a
worker and `saga console`, all on the session's redis-server. The workflow's charge carries an XSS
payload into its tool result; shipping fails; the page, opened before the failure and never
reloaded, shows the unwind as it happens; the policy holds the refund for approval; the operator
approves it from the page; the payments server's SQLite ledger shows the refund.

Screenshots of the main pages are kept under the test's tmp dir. With SAGA_CONSOLE_SCREENSHOT=PATH
the workflow page's is also copied there (`docs/console.png`, shown in the README).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from mcp_saga.examples.ledger import read_state
from mcp_saga.schemas.config import parse_config, write_config
from mcp_saga.schemas.keys import Keys
from processes import free_port, saga_process, start_http_servers, stop, wait_for, wait_until_accepting

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None, reason="needs Debian's chromium and chromium-driver"
)

KEYS = Keys()
WORKFLOW = "order-77"
PAYLOAD = "<img src=x onerror=window.__xss=1><script>window.__xss=2</script>"
USER, PASSWORD = "alice", "browser-test-password"


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or ""
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1440,1700",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER or ""), options=options)
    # Basic auth on every request the page makes, navigation and fetch alike (no prompt when headless).
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}})
    try:
        yield driver
    finally:
        driver.quit()


@contextlib.contextmanager
def real_run(redis_url: str, tmp_path: Path) -> Iterator[tuple[str, dict[str, str], Path]]:
    """Servers, coordinator, worker and console; yields the console URL, server URLs and the payments ledger."""
    dbs = {name: tmp_path / f"{name}.db" for name in ("inventory", "payments", "shipping")}
    # The inventory's release fails once, so the unwind shows a retried attempt.
    specs = [(f"mcp_saga.examples.{name}", "--db", str(db)) for name, db in dbs.items()]
    specs[0] = (*specs[0], "--fail-first", "1")
    with start_http_servers(*specs) as started:
        urls = dict(zip(dbs, (url for _, url in started), strict=True))
        config = write_config(
            parse_config(
                {
                    "servers": {name: {"url": url, "timeout": 10} for name, url in urls.items()},
                    "policy": {"auto": ["*"], "approval": ["payments:*"]},
                    "coordinator": {"block_ms": 100},
                    "worker": {"concurrency": 1, "attempts": 3, "backoff_base": 1.0, "backoff_max": 1.0, "jitter": 0},
                    "console": {"poll_seconds": 0.3},
                }
            ),
            tmp_path / "saga.toml",
        )
        port = free_port()
        procs = [
            saga_process("coordinator", redis_url=redis_url, config=config, log=tmp_path / "coordinator.log"),
            saga_process("worker", redis_url=redis_url, config=config, log=tmp_path / "worker.log"),
            saga_process(
                "console",
                "--port",
                str(port),
                redis_url=redis_url,
                config=config,
                env={"SAGA_CONSOLE_USERS": f"{USER}:{PASSWORD}"},
                log=tmp_path / "console.log",
            ),
        ]
        try:
            wait_until_accepting("127.0.0.1", port, procs[2])
            yield f"http://127.0.0.1:{port}", urls, dbs["payments"]
        finally:
            for proc in procs:
                stop(proc)


async def forward_steps(redis_url: str, urls: dict[str, str], fail: asyncio.Event, go: asyncio.Event) -> str:
    """The orchestrator: reserve, charge (its result carries the payload), then wait for `go` and fail shipping."""
    from mcp import Client

    import mcp_saga

    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(Client(url)) for name, url in urls.items()}
        try:
            async with mcp_saga.workflow(WORKFLOW, redis=redis_url, servers=clients) as wf:
                await wf.call("inventory", "reserve_inventory", {"sku": "SKU-7", "quantity": 2}, step="reserve")
                await wf.call("payments", "charge_payment", {"orderId": PAYLOAD, "amount": 19.5}, step="charge")
                fail.set()
                await go.wait()
                await wf.call(
                    "shipping",
                    "create_shipment",
                    {"orderId": WORKFLOW, "address": "1 Main St", "simulateFailure": True},
                )
        except Exception as exc:  # the failing step: the SDK published workflow-failed
            return str(exc)
    return "completed"


def status_text(driver: Any) -> str:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return driver.find_element(By.ID, "wf-status").text
    except (NoSuchElementException, StaleElementReferenceException):  # mid-navigation, or swapped live
        return ""


def body_text(driver: Any) -> str:
    """The page's text, or "" while a form's POST and redirect have the next page half loaded."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return driver.find_element(By.TAG_NAME, "body").text
    except (NoSuchElementException, StaleElementReferenceException):
        return ""


def comp_status(driver: Any, step: str) -> str:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return driver.find_element(By.CSS_SELECTOR, f"#comp-{step} .badge").text
    except (NoSuchElementException, StaleElementReferenceException):
        return ""


def test_an_unwind_watched_and_approved_in_a_real_browser(
    browser: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    shots = tmp_path / "screenshots"
    shots.mkdir()
    with real_run(redis_url, tmp_path) as (console, urls, payments_db):

        async def scenario() -> str:
            fail, go = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(forward_steps(redis_url, urls, fail, go))
            await fail.wait()
            # Two steps recorded, the workflow still running: open its page now, before it fails.
            await asyncio.to_thread(
                wait_for, lambda: r.hget(KEYS.state(WORKFLOW), "steps") == b"2", 20, "both steps recorded"
            )
            await asyncio.to_thread(browser.get, f"{console}/workflows/{WORKFLOW}")
            await asyncio.to_thread(browser.execute_script, "window.__loaded = 'first load'")
            assert await asyncio.to_thread(status_text, browser) == "running"
            go.set()
            return await task

        assert asyncio.run(scenario()) != "completed"

        # The unwind arrives on the open page, without a reload: the refund is held by the policy.
        charge, reserve = "charge", "reserve"
        wait_for(lambda: comp_status(browser, charge) == "awaiting-approval", 30, "the held refund on the page")
        assert status_text(browser) == "needs-attention"
        assert browser.execute_script("return window.__loaded") == "first load", "the page was not reloaded"
        browser.save_screenshot(str(shots / "workflow-held.png"))

        # The payload in the charge's result is shown as text, and ran nowhere.
        page_text = browser.find_element(By.TAG_NAME, "body").text
        assert PAYLOAD in page_text
        assert browser.execute_script("return window.__xss === undefined")
        assert not browser.find_elements(By.CSS_SELECTOR, "main img")
        assert read_state(payments_db)["summary"] == {"charge": {"charged": 1}}

        # Approve the refund from the page.
        browser.find_element(By.CSS_SELECTOR, f"#comp-{charge} button.act-approve").click()
        wait_for(lambda: "approve applied by alice" in body_text(browser), 20, "applied")
        browser.execute_script("window.__loaded = 'after approve'")

        # The rest of the unwind, live: the refund, then the release (which fails once and is retried).
        wait_for(lambda: status_text(browser) == "compensated", 60, "the workflow compensated on the page")
        assert comp_status(browser, charge) == "succeeded" and comp_status(browser, reserve) == "succeeded"
        assert browser.execute_script("return window.__loaded") == "after approve", "the page was not reloaded"
        assert read_state(payments_db)["summary"] == {"charge": {"refunded": 1}}
        page_text = browser.find_element(By.TAG_NAME, "body").text
        assert "operator-approve" in page_text and USER in page_text  # on the timeline, with who did it
        bars = browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect.attempt")
        kinds = sorted(b.get_attribute("class").split()[1] for b in bars)
        assert kinds.count("succeeded") == 2 and "retrying" in kinds and "refused" in kinds, kinds
        browser.save_screenshot(str(shots / "workflow.png"))

        for name, path in (("workflows", "/workflows"), ("fleet", "/fleet"), ("dead-letters", "/dead-letters")):
            browser.get(console + path)
            browser.save_screenshot(str(shots / f"{name}.png"))
        body = browser.find_element(By.TAG_NAME, "body").text
        assert "no dead letters" in body
        browser.get(console + "/fleet")
        assert "no coordinator has joined" not in browser.find_element(By.TAG_NAME, "body").text

    if target := os.environ.get("SAGA_CONSOLE_SCREENSHOT"):
        shutil.copy(shots / "workflow.png", target)
