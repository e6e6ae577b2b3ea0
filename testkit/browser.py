"""A real headless Chromium (Debian's `chromium`, which scripts/test.sh installs), driven over the DevTools
protocol, for tests of the pages prl writes (`prl rollouts --html`).

    async with open_page(f"file://{page}", tmp_path) as page:
        await page.eval("document.title")                  # any expression, its value returned
        png = await page.screenshot()                      # the viewport as PNG bytes

One browser per `open_page`, with its own profile under the given directory; its log is `chromium.log` there.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import time
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
START_S = 60.0
"""How long a browser may take to open its DevTools port (a cold start on a loaded 2-core machine)."""
WIDTH, HEIGHT = 1280, 900


class BrowserError(RuntimeError):
    pass


class Page:
    """One tab: DevTools commands over its websocket, answered in order of their ids."""

    def __init__(self, ws):
        self.ws, self.next_id = ws, 0

    async def send(self, method: str, **params) -> dict:
        self.next_id += 1
        await self.ws.send_str(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads((await asyncio.wait_for(self.ws.receive(), 30)).data)
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message["result"]

    async def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (an exception in it is a BrowserError)."""
        out = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise BrowserError(f"{expression}: {out['exceptionDetails'].get('exception', out['exceptionDetails'])}")
        return out["result"].get("value")

    async def screenshot(self) -> bytes:
        return base64.b64decode((await self.send("Page.captureScreenshot", format="png"))["data"])


def _devtools_port(profile: Path, proc: subprocess.Popen) -> int:
    deadline = time.monotonic() + START_S
    marker = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BrowserError(f"chromium exited with {proc.returncode}; see {profile / 'chromium.log'}")
        if marker.exists() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        time.sleep(0.1)
    raise BrowserError(f"chromium opened no DevTools port in {START_S:g} s; see {profile / 'chromium.log'}")


@asynccontextmanager
async def open_page(url: str, directory: Path) -> AsyncIterator[Page]:
    """A headless Chromium showing `url` once its document has loaded (scripts run)."""
    import aiohttp

    if CHROMIUM is None:
        raise BrowserError("no chromium on PATH: apt-get install chromium (scripts/test.sh installs it)")
    profile = directory / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    log = open(profile / "chromium.log", "wb")
    proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--remote-debugging-port=0", f"--user-data-dir={profile}",
                             f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        port = await asyncio.to_thread(_devtools_port, profile, proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            target = next(t for t in json.load(r) if t["type"] == "page")
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                # The window's size includes what a headed window would draw around the page: set the page's own.
                await page.send("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT,
                                deviceScaleFactor=1, mobile=False)
                await page.send("Page.navigate", url=url)
                deadline = time.monotonic() + 30
                while await page.eval("document.readyState") != "complete" or \
                        await page.eval("location.href") == "about:blank":
                    if time.monotonic() > deadline:
                        raise BrowserError(f"{url} did not load in 30 s")
                    await asyncio.sleep(0.1)
                yield page
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
