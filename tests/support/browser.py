"""A page opened in a real headless browser: Debian's chromium (``/usr/bin/chromium``; CI's
``.ci/run`` installs it), driven by playwright (which downloads no browser of its own here),
offline: every request that leaves the page's own file fails the test."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

#: Chromium's flags for a headless run that talks to nothing but the page.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium() -> str | None:
    """The system's chromium, if it is installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def open_page(
    path: Path, script: str, *, screenshot: Path | None = None, timeout: float = 60.0
) -> dict[str, Any]:
    """Open ``path`` (a local HTML file), wait for it to load, run ``script`` (a JS function
    body's expression, evaluated in the page) and return ``{"value", "console_errors",
    "page_errors", "requests"}``: what ``script`` returned, every console message of type
    ``error``, every uncaught exception, and every URL the page asked for besides itself.
    ``screenshot``: a PNG of the whole page is written there."""
    from playwright.sync_api import sync_playwright

    executable = chromium()
    assert executable is not None, "chromium is not installed"
    errors: list[str] = []
    page_errors: list[str] = []
    requests: list[str] = []
    url = path.resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="relax-browser-") as profile, sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            profile,
            executable_path=executable,
            headless=True,
            args=list(FLAGS),  # the profile directory is playwright's --user-data-dir
            viewport={"width": 1280, "height": 900},
        )
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url) if r.url != url else None)
            page.goto(url, wait_until="load", timeout=timeout * 1000)
            page.wait_for_load_state("networkidle", timeout=timeout * 1000)
            value = page.evaluate(script)
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return {
        "value": value,
        "console_errors": errors,
        "page_errors": page_errors,
        "requests": requests,
    }
