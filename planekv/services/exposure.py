"""Refusing to serve a REST API without a bearer token where other hosts can reach it.

Without ``api_token`` anyone who reaches the port may read, overwrite and delete what the service
holds. On a loopback address that is only this host; elsewhere the service refuses to start unless
``allow_no_token`` (``--allow-no-token``) says the open API is meant, and then warns loudly.
"""

from __future__ import annotations

import ipaddress
import logging

from ..settings import Settings

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses; any other name may be reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(service: str, host: str, settings: Settings) -> None:
    """Raise SystemExit if ``service`` would serve ``host`` (not loopback) without a token and
    that was not allowed; warn if it was allowed."""
    if settings.api_token or is_loopback(host):
        return
    if not settings.allow_no_token:
        raise SystemExit(
            f"refusing to start the {service} on {host} without an API token: any host that reaches it could "
            "read, overwrite and delete its data. Set PLANEKV_API_TOKEN (the container image reads it from "
            "PLANEKV_API_TOKEN_FILE), bind to 127.0.0.1, or pass --allow-no-token (PLANEKV_ALLOW_NO_TOKEN=true) "
            "if an open API is really meant")
    log.warning("THE %s SERVES %s WITHOUT AN API TOKEN (--allow-no-token): anyone who reaches this address can "
                "read, overwrite and delete its data; set PLANEKV_API_TOKEN to require a bearer token",
                service.upper(), host)
