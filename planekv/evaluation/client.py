"""Registering a calibration artifact with the control plane (issue 5's API).

``PUT {url}/v1/calibrations/{calibration_id}`` with the artifact bytes (application/octet-stream),
optional bearer token; 201 = created, 200 = already there with the same bytes. Only loopback
addresses are contacted, with a short timeout, so a missing control plane costs nothing.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from urllib.parse import urlparse

from ..kvstore import Calibration

log = logging.getLogger(__name__)


def is_loopback_url(url: str) -> bool:
    """True if ``url``'s host resolves only to loopback addresses (127.0.0.0/8, ::1)."""
    host = urlparse(url).hostname
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def register_calibration(calibration: Calibration, url: str | None, token: str | None = None,
                         timeout_s: float = 2.0) -> tuple[bool, str]:
    """(registered, message). Never raises: an unreachable or refusing server is reported."""
    if not url:
        return False, "no control plane configured; artifact not registered"
    if not is_loopback_url(url):
        return False, f"control plane {url} is not a loopback address; not contacted"
    try:
        import httpx
    except ImportError:
        return False, "httpx is not installed (pip install 'planekv[eval]'); not registered"
    cid = calibration.calibration_id
    headers = {"content-type": "application/octet-stream"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    target = f"{url.rstrip('/')}/v1/calibrations/{cid}"
    try:
        r = httpx.put(target, content=calibration.to_bytes(), headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return False, f"control plane at {url} not reachable ({type(exc).__name__}); not registered"
    if r.status_code == 201:
        return True, f"registered calibration {cid} with {url} (created)"
    if r.status_code == 200:
        return True, f"calibration {cid} already registered with {url} (same bytes)"
    return False, f"control plane at {url} refused calibration {cid}: HTTP {r.status_code} {r.text[:200]}"
