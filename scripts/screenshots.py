"""Screenshots of the demo page for the README: docs/demo-chat.png and docs/demo-scheduler.png.

Starts `streamgate serve` (default model, examples/tenants.toml) on a free port, opens the
page in Debian's headless chromium, asks one question, then starts the load control and
captures the scheduler view while the load runs.

    .venv/bin/python scripts/screenshots.py [--out docs] [--load 6]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

from bench import server

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
QUESTION = "Explain continuous batching in two sentences."


def number(page, element_id: str) -> int:
    text = page.text_content(f"#{element_id}") or ""
    return int(text) if text.isdigit() else 0


def capture(url: str, out: Path, load: int) -> None:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(180_000)
        expect.set_options(timeout=180_000)
        page.goto(url)
        expect(page.locator("#conn-status")).to_contain_text("Connected")
        page.fill("#max-tokens", "96")
        page.fill("#temperature", "0")
        page.fill("#prompt", QUESTION)
        page.press("#prompt", "Enter")
        expect(page.get_by_test_id("finish-reason")).to_have_count(1)
        page.wait_for_timeout(1500)         # a few more stats ticks after the answer
        page.locator("#prompt").blur()
        page.screenshot(path=str(out / "demo-chat.png"))
        print(f"wrote {out / 'demo-chat.png'}")

        page.fill("#load-n", str(load))
        page.click("#load-start")
        page.fill("#prompt", "And what is chunked prefill?")
        page.press("#prompt", "Enter")
        # Let the latency chart fill for a while, then wait for a step where a chunked
        # prefill shares the batch with decodes (give up after two minutes).
        start = time.monotonic()
        while time.monotonic() - start < 120:
            busy = number(page, "stat-running") >= min(load, 3)
            mixed = number(page, "stat-prefill") > 0 and number(page, "stat-decode") > 0
            if time.monotonic() - start > 10 and busy and mixed:
                break
            page.wait_for_timeout(100)
        page.locator("#prompt").blur()
        page.locator("#load-running").scroll_into_view_if_needed()
        page.screenshot(path=str(out / "demo-scheduler.png"))
        print(f"wrote {out / 'demo-scheduler.png'}")
        page.click("#load-stop")
        if page.is_enabled("#stop"):
            page.click("#stop")
        expect(page.get_by_test_id("load-running")).to_have_text("0")
        browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs"))
    parser.add_argument("--load", type=int, default=6, help="background requests while the scheduler shot is taken")
    args = parser.parse_args(argv)
    if not os.path.exists(CHROMIUM):
        print("screenshots: Debian's chromium is missing; run: sudo apt-get install -y chromium", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = server.launch(["--tenants", str(ROOT / "examples" / "tenants.toml"),
                                   "--ledger", str(Path(tmp) / "usage.sqlite3")], Path(tmp) / "server.log", cwd=ROOT)
        try:
            capture(f"{url}/", out, args.load)
        finally:
            server.stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
