"""``/docs`` on both live services: a self-contained page (no CDN), listing the operations."""

from __future__ import annotations

import re

import httpx
import pytest


@pytest.mark.parametrize("service, operation", [("control", "/v1/formats"), ("store", "/v1/blocks:batch-get")])
def test_docs_work_offline(service, operation, request):
    url = request.getfixturevalue(service).url
    r = httpx.get(f"{url}/docs", timeout=10)  # no token: the page, like /openapi.json, is public
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", r.text, re.I), "the page refers outside the service"
    assert operation in r.text and 'href="/openapi.json"' in r.text
    assert httpx.get(f"{url}/redoc", timeout=10).status_code == 404  # ReDoc's page loads from a CDN too
