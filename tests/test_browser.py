"""The demo page (static/) in headless Chromium against the real app on a real uvicorn:
streaming chat, Stop, a wrong key, the load control and phone width.

Debian's chromium is driven by PyPI playwright (no browser download). These tests never
skip: without /usr/bin/chromium they fail and say how to install it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from tenants import Registry
from tests.held_engine import HeldEngine
from tests.live import engine_config, serve, wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
TENANTS_FILE = Path(__file__).resolve().parent.parent / "examples" / "tenants.toml"
TIMEOUT_MS = 60_000         # a ceiling on waiting for an event, not a verdict on speed: a loaded 2-core host took 18.5 s
expect.set_options(timeout=TIMEOUT_MS)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    """The real app with the shipped tenants file, so the page's default demo key must work
    (its max_tokens raised to 1990, for a long answer to stop), on the tiny model's real engine,
    stepping freely unless a test holds it (tests/held_engine.py)."""
    tmp = tmp_path_factory.mktemp("browser")
    tenants = tmp / "tenants.toml"
    tenants.write_text(TENANTS_FILE.read_text().replace("max_tokens = 1024", "max_tokens = 1990"))
    model = tiny_model("llama")
    engine = HeldEngine(engine_config(model), steps=None)
    with serve(model, tmp, engine=engine, registry=Registry.from_file(str(tenants))) as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing; the browser tests need Debian's chromium. Install it with:\n"
                    "    sudo apt-get install -y chromium        (or: sh scripts/ensure_chromium.sh)", pytrace=False)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Tab:
    """A fresh browser context (empty localStorage) with its console problems collected."""

    def __init__(self, browser, live, width: int = 1280, height: int = 800):
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page: Page = self.context.new_page()
        self.problems: list[str] = []
        self.sent: list[dict] = []          # frames the page sent, each with "_socket": which socket
        self.sockets = 0
        self.page.on("console", lambda m: self.problems.append(f"console.{m.type}: {m.text}")
                     if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda exc: self.problems.append(f"pageerror: {exc}"))
        self.page.on("websocket", self._socket)
        self.page.goto(live.url + "/")
        expect(self.page.locator("#conn-status")).to_have_text(re.compile("Connected"))

    def _socket(self, ws) -> None:
        self.sockets += 1
        n = self.sockets
        ws.on("framesent", lambda payload: self.sent.append({**json.loads(payload), "_socket": n})
              if isinstance(payload, str) else None)

    def ask(self, text: str, max_tokens: int, temperature: str = "0") -> None:
        self.page.fill("#max-tokens", str(max_tokens))
        self.page.fill("#temperature", temperature)
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def watch_streaming_text(self, click_stop: bool = False) -> None:
        """Record, from inside the page, the moment an answer still streaming first shows text
        (and click Stop then, if asked). Polling from the test is too slow: on a fast host the
        tiny model writes 120 tokens in ~150 ms and the answer has ended before a poll sees it."""
        self.page.evaluate("""(clickStop) => {
            window.sawStreamingText = false;
            const stop = document.querySelector('#stop');
            const obs = new MutationObserver(() => {
                const text = document.querySelector('.msg.assistant.streaming .content');
                if (!text || text.textContent.length === 0) return;
                if (clickStop && stop.disabled) return;
                obs.disconnect();
                window.sawStreamingText = true;
                if (clickStop) stop.click();
            });
            obs.observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});
        }""", click_stop)

    def wait_streaming_text(self) -> None:
        self.page.wait_for_function("window.sawStreamingText === true")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser, live):
    tab = Tab(browser, live)
    yield tab
    tab.close()


def engine_idle(live) -> bool:
    stats = live.engine_stats()
    return stats["running"] == 0 and stats["kv_blocks_used"] == 0


def stat(page: Page, testid: str) -> int:
    text = page.get_by_test_id(testid).text_content()
    return int(text) if text and text.isdigit() else -1


def test_chat_streams_multi_turn_and_stats_update(tab):
    """The page loads cleanly, streams answers turn after turn with the history, and the stats move."""
    page = tab.page
    page.wait_for_function("/^\\d+$/.test(document.getElementById('stat-gen-tokens').textContent)")
    generated = stat(page, "stat-gen-tokens")
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")
    page.type("#prompt", "second line")
    assert page.input_value("#prompt") == "first line\nsecond line"
    assert page.locator(".msg").count() == 0, "Shift+Enter must not send"

    tab.watch_streaming_text()
    tab.ask("Hello there, how are you?", max_tokens=120)
    tab.wait_streaming_text()
    answer = page.get_by_test_id("answer").last
    expect(answer.get_by_test_id("finish-reason")).to_have_text(re.compile("^(length|stop)$"))
    assert int(answer.get_by_test_id("tokens").text_content()) > 0
    expect(answer.get_by_test_id("ttft")).to_have_text(re.compile(r"^\d.* \(server \d"))
    first_answer = answer.locator(".content").text_content()
    assert first_answer
    page.wait_for_function(f"Number(document.getElementById('stat-gen-tokens').textContent) > {generated}")

    tab.ask("And a second question?", max_tokens=5)
    expect(page.get_by_test_id("finish-reason")).to_have_count(2)
    requests = [f for f in tab.sent if f.get("type") == "chat.request"]
    assert [m["role"] for m in requests[-1]["messages"]] == ["user", "assistant", "user"]
    assert requests[-1]["messages"][1]["content"] == first_answer
    assert tab.problems == []


def test_stop_aborts_the_answer_and_frees_the_engine(tab, live):
    """Stop sends chat.cancel: the answer ends with finish reason abort and the engine frees its blocks."""
    page = tab.page
    # The 1900-token answer is held after 16 engine steps until it is stopped (the tiny model
    # writes all of it in under 2 s on a fast host); Stop is clicked from inside the page the
    # moment the first answer text arrives.
    live.gateway.engine.hold(16)
    try:
        tab.watch_streaming_text(click_stop=True)
        tab.ask("Tell me a long story.", max_tokens=1900)
        tab.wait_streaming_text()
        answer = page.get_by_test_id("answer").last
        expect(answer.get_by_test_id("finish-reason")).to_have_text("abort")
        assert 0 < int(answer.get_by_test_id("tokens").text_content()) < 1900
        assert wait_until(lambda: engine_idle(live)), live.engine_stats()
    finally:
        live.gateway.engine.release()
    expect(page.locator("#stop")).to_be_disabled()
    expect(page.locator("#send")).to_be_enabled()
    assert tab.problems == []


def test_wrong_key_shows_invalid_api_key(tab):
    """A wrong key is refused (close 1008) and the page says 'invalid API key' and stops retrying."""
    page = tab.page
    page.fill("#api-key", "sk-not-a-real-key")
    page.press("#api-key", "Enter")
    expect(page.locator("#conn-status")).to_contain_text("invalid API key")
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "rejected")
    expect(page.locator("#banner")).to_contain_text("invalid API key")
    assert page.evaluate("localStorage.getItem('streamgate.apiKey')") == "sk-not-a-real-key"
    page.wait_for_timeout(1200)      # past the first reconnect delay: still rejected, no retry loop
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "rejected")
    assert tab.problems == []


def test_deadline_and_rate_limit_are_shown(tab, live):
    """A passed deadline reads as a deadline; a 429 shows its limit and a countdown that re-enables Send."""
    page = tab.page
    page.fill("#deadline", "1")
    tab.ask("Hello", max_tokens=20)
    expect(page.get_by_test_id("answer-error")).to_have_attribute("data-kind", "deadline")
    expect(page.get_by_test_id("answer-error")).to_contain_text("Deadline passed")
    page.fill("#deadline", "")

    demo = live.gateway.registry.authenticate("sg-demo-localhost-only")
    leases = [live.gateway.quotas.reserve(demo, 1) for _ in range(demo.limits.max_concurrent)]
    try:
        tab.ask("Hello again", max_tokens=20)
        expect(page.locator("#banner")).to_contain_text(re.compile(r"Rate limited \(max_concurrent\).*Retry in \d+ s"))
        expect(page.get_by_test_id("answer-error").last).to_have_attribute("data-kind", "rate_limit")
        expect(page.locator("#send")).to_be_disabled()
    finally:
        for lease in leases:
            lease.settle(0)
    expect(page.locator("#banner")).to_contain_text("You can retry now")
    expect(page.locator("#send")).to_be_enabled()
    tab.ask("Hello once more", max_tokens=5)
    expect(page.get_by_test_id("finish-reason")).to_have_count(1)
    sent = [f for f in tab.sent if f.get("type") == "chat.request"]
    assert [len(f["messages"]) for f in sent] == [1, 1, 1], "failed turns must not enter the history"
    assert tab.problems == []


def test_load_runs_on_a_second_socket_and_stops(tab, live):
    """Start load keeps N requests running on a second socket; Stop load cancels them all."""
    page = tab.page
    page.fill("#load-n", "3")
    page.click("#load-start")
    page.wait_for_function("Number(document.getElementById('load-done').textContent) >= 1")
    expect(page.get_by_test_id("load-running")).to_have_text(re.compile("^[1-3]$"))
    sockets = {f["_socket"] for f in tab.sent if str(f.get("id", "")).startswith("load-")}
    assert len(sockets) == 1 and 1 not in sockets, "load must use its own socket"
    assert {f["type"] for f in tab.sent if f["_socket"] in sockets} >= {"auth", "chat.request"}
    page.click("#load-stop")
    expect(page.get_by_test_id("load-running")).to_have_text("0")
    expect(page.locator("#load-start")).to_be_enabled()
    assert wait_until(lambda: engine_idle(live)), live.engine_stats()
    assert tab.problems == []


def test_phone_width_has_no_horizontal_overflow(browser, live):
    """At 375 px wide the page is one column with nothing wider than the screen, answers included."""
    tab = Tab(browser, live, width=375, height=740)
    try:
        page = tab.page
        tab.ask("Hi", max_tokens=120)
        expect(page.get_by_test_id("finish-reason")).to_have_count(1)
        width = page.evaluate("document.scrollingElement.scrollWidth")
        assert width <= 375 + 1, f"the page is {width}px wide at a 375px viewport"
        for selector in ("#send", "#stop", "#clear", "#kv-bar", "#itl-chart", "#load-start"):
            box = page.locator(selector).bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= 376, (selector, box)
        assert tab.problems == []
    finally:
        tab.close()


def test_server_restart_is_shown(browser, tiny_model, tmp_path):
    """A draining server closes the socket with 1012 and the page says it is restarting."""
    registry = Registry.from_file(str(TENANTS_FILE))
    with serve(tiny_model("llama"), tmp_path, registry=registry, drain_grace_s=5) as server:
        tab = Tab(browser, server)
        try:
            server.sigterm()
            try:
                expect(tab.page.locator("#banner")).to_contain_text("restarting (close 1012)")
            except AssertionError as exc:     # seen once in a full run (2026-12-07): say what the page saw instead
                status = tab.page.locator("#conn-status").text_content()
                raise AssertionError(f"{exc}\n#conn-status: {status!r}; sockets opened: {tab.sockets}; "
                                     f"page problems: {tab.problems}") from exc
            expect(tab.page.locator("#conn-status")).to_have_attribute("data-state", re.compile("retrying|connecting"))
        finally:
            tab.close()
