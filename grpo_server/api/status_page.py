"""The status page at `/`: experiments, their counters and reward curves, for a person with a browser.

The page itself holds no data, so it is public; its script reads the JSON API with the key the person
gives it (`/#key=...` or the page's box; the fragment never reaches the server). It is one file,
`static/status.html`, with its style and script inline and no outside resources: a Content-Security-Policy
allows exactly those two inline blocks (by hash) and requests to this server only.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from aiohttp import web

PAGE = "status.html"


def _sha256_source(block: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(block.encode()).digest()).decode() + "'"


@functools.cache
def page_and_policy() -> tuple[bytes, str]:
    html = (resources.files("grpo_server.api") / "static" / PAGE).read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    styles = re.findall(r"<style>(.*?)</style>", html, flags=re.S)
    policy = "; ".join([
        "default-src 'none'",
        "script-src " + " ".join(map(_sha256_source, scripts)),
        "style-src " + " ".join(map(_sha256_source, styles)),
        "connect-src 'self'",
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])
    return html.encode(), policy


async def status_page(request: web.Request) -> web.Response:
    html, policy = page_and_policy()
    return web.Response(body=html, content_type="text/html", charset="utf-8", headers={
        "Content-Security-Policy": policy, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})
