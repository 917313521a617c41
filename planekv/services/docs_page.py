"""``/docs`` without a CDN, for both services.

FastAPI's Swagger UI and ReDoc pages load their JavaScript and CSS from a CDN, which an offline or
air-gapped host cannot reach (the page stays blank). This page is plain HTML rendered on the server
from the app's OpenAPI schema: every operation with its summary, parameters, body and answers, and a
link to the schema itself for tools (Swagger UI, schemathesis, client generators).
"""

from __future__ import annotations

from html import escape
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

_METHODS = ("get", "put", "post", "patch", "delete", "head")
_STYLE = ("body{font-family:sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;line-height:1.4}"
          "code{background:#f3f3f3;padding:0 .2rem}h2{margin-top:2rem;border-bottom:1px solid #ccc}"
          ".op{margin:1rem 0}.m{font-weight:bold;text-transform:uppercase;display:inline-block;width:4.5rem}"
          ".d{margin:.2rem 0 0 4.5rem;color:#333;white-space:pre-wrap}")


def _operation(path: str, method: str, op: dict[str, Any]) -> str:
    params = ", ".join(f"{p['name']} ({p['in']}{', required' if p.get('required') else ''})"
                       for p in op.get("parameters", []))
    body = ", ".join(op.get("requestBody", {}).get("content", {}))
    answers = ", ".join(sorted(op.get("responses", {})))
    details = [op.get("description", "")]
    if params:
        details.append(f"Parameters: {params}")
    if body:
        details.append(f"Body: {body}")
    details.append(f"Answers: {answers}")
    return (f'<div class="op"><span class="m">{escape(method)}</span><code>{escape(path)}</code> '
            f"{escape(op.get('summary', ''))}"
            f'<div class="d">{escape(chr(10).join(d for d in details if d))}</div></div>')


def render_docs(schema: dict[str, Any], openapi_url: str) -> str:
    info = schema.get("info", {})
    title = escape(f"{info.get('title', 'API')} {info.get('version', '')}".strip())
    sections: dict[str, list[str]] = {}
    for path, item in schema.get("paths", {}).items():
        for method in _METHODS:
            if method in item:
                tag = (item[method].get("tags") or ["other"])[0]
                sections.setdefault(tag, []).append(_operation(path, method, item[method]))
    body = "".join(f"<h2>{escape(tag)}</h2>{''.join(ops)}" for tag, ops in sections.items())
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title><style>{_STYLE}</style>"
            f"</head><body><h1>{title}</h1><p>{escape(info.get('description', ''))}</p>"
            f'<p>The OpenAPI schema: <a href="{escape(openapi_url)}">{escape(openapi_url)}</a> (load it in any '
            "OpenAPI viewer or client generator).</p>"
            f"{body}</body></html>")


def install_docs(app: FastAPI) -> None:
    """Serve the page at ``/docs``; the app must be built with ``docs_url=None, redoc_url=None``."""
    openapi_url = app.openapi_url
    assert openapi_url, "the docs page links the OpenAPI schema: keep openapi_url"

    @app.get("/docs", include_in_schema=False, response_class=HTMLResponse)
    async def docs(request: Request) -> HTMLResponse:
        return HTMLResponse(render_docs(app.openapi(), request.scope.get("root_path", "") + openapi_url))
