"""Screenshot a page that keeps working after its load event (Model Explorer renders the graph
with WebGL after loading it), through the Chrome DevTools protocol of a headless chromium::

    python tools/cdp_screenshot.py URL OUT.png [WAIT_S] [--at X,Y]...

``--at X,Y`` clicks the page at (X, Y) CSS pixels (after WAIT_S / 2; then waits WAIT_S / 2 again).
Needs chromium on PATH and tornado (installed with jupyter's ipykernel).
"""
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from tornado.ioloop import IOLoop
from tornado.websocket import websocket_connect

PORT = 9333


async def _shoot(ws_url: str, url: str, out: str, wait: float, clicks: list) -> None:
    ws = await websocket_connect(ws_url, max_message_size=64 << 20)
    ids = iter(range(1, 1 << 30))

    async def call(method: str, **params):
        n = next(ids)
        await ws.write_message(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            msg = json.loads(await ws.read_message())
            if msg.get("id") == n:
                return msg.get("result", {})

    await call("Emulation.setDeviceMetricsOverride", width=1400, height=900, deviceScaleFactor=1, mobile=False)
    await call("Page.navigate", url=url)
    time.sleep(wait / 2)
    for xy in clicks:
        x, y = (float(v) for v in xy.split(","))
        for kind in ("mousePressed", "mouseReleased"):
            await call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
        time.sleep(wait / 2)
    shot = await call("Page.captureScreenshot", format="png")
    with open(out, "wb") as fh:
        fh.write(base64.b64decode(shot["data"]))
    ws.close()


def main() -> None:
    args = sys.argv[1:]
    clicks = [args[i + 1] for i, a in enumerate(args) if a == "--at"]
    pos = [a for i, a in enumerate(args) if a != "--at" and (i == 0 or args[i - 1] != "--at")]
    url, out = pos[0], pos[1]
    wait = float(pos[2]) if len(pos) > 2 else 20.0
    profile = tempfile.mkdtemp(prefix="cdp-")
    browser = subprocess.Popen(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--enable-unsafe-swiftshader",
                                "--hide-scrollbars", f"--remote-debugging-port={PORT}", f"--user-data-dir={profile}",
                                "--window-size=1400,900", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            try:
                pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{PORT}/json/list"))
                page = next(p for p in pages if p.get("type") == "page")
                break
            except Exception:
                time.sleep(0.2)
        IOLoop.current().run_sync(lambda: _shoot(page["webSocketDebuggerUrl"], url, out, wait, clicks))
        print(f"wrote {out}")
    finally:
        browser.send_signal(signal.SIGTERM)
        browser.wait(timeout=10)


if __name__ == "__main__":
    main()
