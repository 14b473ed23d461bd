"""/docs and /redoc work on an air-gapped machine: every asset they load is served by the planner."""

from __future__ import annotations

import re

import httpx


def test_the_api_docs_load_nothing_from_elsewhere(server):
    with httpx.Client(base_url=server.url, trust_env=False) as http:
        for page in ("/docs", "/redoc"):
            resp = http.get(page)
            assert resp.status_code == 200
            html = resp.text
            urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", html)
            assert urls, html
            assert not [u for u in urls if re.match(r"^(https?:)?//", u)], urls  # no CDN, no fonts
            for url in urls:
                if url.startswith("/docs-static/"):
                    asset = http.get(url)
                    assert asset.status_code == 200, url
                    assert len(asset.content) > 1000, url
        assert http.get("/openapi.json").status_code == 200
