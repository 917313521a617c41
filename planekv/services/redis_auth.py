"""Redis's password on the client side: read from a file, never shown (free of the redis package, so launchers
import it cheaply)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


class RedisPasswordError(ValueError):
    """The Redis password cannot be read or is given twice (the message names the file and what to do)."""


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (``redis://:***@host:6379/0``): the only form logged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def read_password_file(path: Path) -> str:
    """The password in ``path`` (one line; a trailing newline is dropped); RedisPasswordError naming the file if it
    is missing, unreadable or empty."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise RedisPasswordError(f"cannot read the Redis password file {path} ({exc.strerror}); point "
                                 "PLANEKV_REDIS_PASSWORD_FILE at a readable file holding Redis's requirepass") from None
    password = text.rstrip("\r\n")
    if not password or "\n" in password:
        raise RedisPasswordError(f"the Redis password file {path} must hold the password on one line "
                                 f"({'it is empty' if not password else 'it has several lines'})")
    return password
