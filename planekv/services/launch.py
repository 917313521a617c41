"""Starting PlaneKV's processes on this machine: what `planekv up` (planekv.orchestration.stack), `planekv bench
load` (planekv.bench.load) and the test fixtures share.

Redis is always started from a config file this module writes (mode 0600): ``requirepass`` from a password file,
an append-only file fsynced every second (or as asked), no RDB snapshots, loopback only. The password is therefore
in no command line, environment or log; clients read it from the same file (``PLANEKV_REDIS_PASSWORD_FILE``).

Every process runs in a session of its own (the terminal's Ctrl-C reaches only the launcher), logs to a file, is
waited for with a bounded loop and stopped by its process group, then by every descendant that left the group.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from .redis_auth import read_password_file

REDIS_CONF = "redis.conf"
STOP_GRACE_S = 15.0


# ---- ports and secrets ----

def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is bound again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now: every socket stays bound until all are chosen (one
    ``free_port`` after another can hand out the same port twice)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def port_busy(port: int) -> bool:
    """Whether something listens on (or holds) the loopback ``port``. SO_REUSEADDR as servers bind: a port whose
    last connections wait in TIME_WAIT (a stack just stopped) is free for them, and so is it here."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def new_secret_file(path: Path) -> Path:
    """``path`` holding a new random secret (64 hex digits), created with mode 0600 (never readable by others, not
    even for a moment); an existing file is kept as it is. Returns ``path``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


# ---- redis ----

def _conf_value(value: str) -> str:
    """A redis.conf argument in double quotes, so spaces, quotes and backslashes in paths and passwords survive."""
    out = []
    for ch in value:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return '"' + "".join(out) + '"'


def redis_command(redis_server: str, port: int, data_dir: Path, password_file: Path,
                  appendfsync: str = "everysec") -> list[str]:
    """The argv that starts ``redis-server`` on 127.0.0.1:``port`` requiring the password in ``password_file``,
    with its append-only file in ``data_dir``. Writes ``data_dir/redis.conf`` (mode 0600: it holds the
    password); raises RedisPasswordError naming the file if the password cannot be read."""
    if appendfsync not in ("always", "everysec", "no"):
        raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
    password = read_password_file(password_file)
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"port {port}", "bind 127.0.0.1", "protected-mode yes", f"dir {_conf_value(str(data_dir))}",
             "appendonly yes", f"appendfsync {appendfsync}", 'save ""', f"requirepass {_conf_value(password)}"]
    conf = data_dir / REDIS_CONF
    conf.unlink(missing_ok=True)  # recreated 0600 whatever mode an old one had
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# written by planekv.services.launch; holds the password: keep it 0600\n" + "\n".join(lines) + "\n")
    return [redis_server, str(conf)]


def _resp(*args: str) -> bytes:
    """A command in Redis's wire protocol (RESP): any byte in an argument is safe."""
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def redis_ping(port: int, password: str | None, timeout: float = 1.0) -> bool:
    """True if the Redis on 127.0.0.1:``port`` accepts ``password`` (AUTH) and answers PING (not while it is still
    loading its append-only file)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall((_resp("AUTH", password) if password is not None else b"") + _resp("PING"))
            want = (b"+OK\r\n" if password is not None else b"") + b"+PONG\r\n"
            got = b""
            while len(got) < len(want) and not got.startswith(b"-"):
                chunk = s.recv(64)
                if not chunk:
                    break
                got += chunk
            return got.startswith(want)
    except OSError:
        return False


# ---- http ----

def http_ok(url: str, token: str | None = None, path: str = "/healthz") -> bool:
    """True if GET ``url + path`` answers 200 within 2 s."""
    import httpx

    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        return httpx.get(url + path, headers=headers, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


# ---- processes ----

class Launched(Protocol):
    """What the waits need of a started process (stack.Component and bench.load.Service are ones)."""

    name: str
    pid: int | None

    @property
    def log(self) -> str | Path | None: ...


L = TypeVar("L", bound=Launched)


def spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a session of its own, stdout and stderr appended to ``log``, no stdin."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def log_tail(log: str | Path | None, n: int = 2000) -> str:
    try:
        return Path(log).read_text()[-n:] if log else ""
    except OSError:
        return ""


def wait_ready(procs: Sequence[L], ready: Callable[[L], bool], deadline: float, error: type[Exception],
               on_ready: Callable[[L], None] = lambda p: None) -> None:
    """Poll until ``ready(p)`` for every process, calling ``on_ready`` as each becomes so; raise ``error`` with the
    log's tail if one exits, or naming those still waited for at ``deadline`` (time.monotonic())."""
    todo = list(procs)
    while todo:
        for p in list(todo):
            if p.pid is not None and not alive(p.pid):
                raise error(f"{p.name} exited while starting (log {p.log}):\n{log_tail(p.log)}")
            if ready(p):
                on_ready(p)
                todo.remove(p)
        if todo and time.monotonic() > deadline:
            where = Path(todo[0].log).parent if todo[0].log else "?"
            raise error(f"not healthy in time: {', '.join(p.name for p in todo)} (logs in {where})")
        if todo:
            time.sleep(0.1)


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def stop_group(pid: int, grace_s: float = STOP_GRACE_S) -> bool:
    """SIGTERM the process group ``pid`` leads, wait up to ``grace_s``, SIGKILL what is left of it and of every
    descendant that left the group (Ray starts its workers in groups of their own; Redis's AOF-rewrite child);
    True if it was running."""
    was_alive = alive(pid)
    family = descendants(pid)
    _killpg(pid, signal.SIGTERM if was_alive else signal.SIGKILL)  # a dead leader's children may outlive it

    def left() -> list[int]:
        return ([pid] if alive(pid) else []) + group_members(pid) + [p for p in family if alive(p)]

    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and left():
        time.sleep(0.1)
    _killpg(pid, signal.SIGKILL)
    for p in left():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and left():
        time.sleep(0.05)
    return was_alive


def descendants(pid: int) -> list[int]:
    """Live processes below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for p, fields in _proc_stats():
        children.setdefault(int(fields[1]), []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    return [p for p, fields in _proc_stats() if int(fields[2]) == pgid]


def _proc_stats() -> list[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name) of every live, non-zombie process."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().split(")")[-1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            out.append((int(d.name), fields))
    return out


def _killpg(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
