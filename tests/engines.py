"""Throw-away PostgreSQL and redis-server processes for the several-routers tests, from Debian's
packages (scripts/setup installs them). Each lives in a temp folder and is stopped by PID.

PostgreSQL refuses to run as root, so as root the cluster is made and run by the `postgres`
user (its folder is handed to that user); as anyone else it runs as the current user. Both
listen on 127.0.0.1 only, on a free port, with trust auth (or the `password` given: the wrong
password tests): nothing outside this machine reaches them and they hold only test data.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout}s")


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """redis-server on a free loopback port, no persistence; `stop` and `start` again on the
    same port (the outage tests). With `password`, it requires it (`url` carries it)."""

    def __init__(self, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/setup installs it)")
        self.binary = binary
        self.port = _free_port()
        self.password = password
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self.socket = Path(tempfile.mkdtemp(prefix="router-redis-")) / "redis.sock"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning",
             "--unixsocket", str(self.socket), "--unixsocketperm", "700",
             *(("--requirepass", self.password) if self.password else ())],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port, self.proc, "redis-server")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            _stop(self.proc, sig)


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError("PostgreSQL is not installed (scripts/setup installs it)")
    return found[-1]


class PostgresServer:
    """A cluster of its own in a temp folder; `database(name)` makes a fresh database and returns
    its URL. `stop` and `start` again keep the data (the outage tests). With `password`, every
    connection needs it (scram-sha-256; the URLs carry it)."""

    def __init__(self, password: str | None = None) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="router-pg-"))
        self.data = self.folder / "data"
        self.port = _free_port()
        self.password = password
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.folder, "postgres", "postgres")
            os.chmod(self.folder, 0o700)
        auth = ["-A", "trust"]
        if password:
            (self.folder / "password").write_text(password)
            auth = ["-A", "scram-sha-256", "--pwfile", str(self.folder / "password")]
        self._run(_pg_bin("initdb"), "-D", str(self.data), *auth, "-U", "postgres", "--no-sync", "-E", "UTF8")
        self.proc: subprocess.Popen | None = None
        self.start()
        self.url = self._url("postgres")

    def _url(self, database: str) -> str:
        return f"postgresql://postgres{f':{self.password}' if self.password else ''}@127.0.0.1:{self.port}/{database}"

    def _as(self) -> dict:
        """Popen's arguments that run a program as `postgres` when we are root (so the process we
        hold, and signal, is postgres itself), psql's password in its environment."""
        env = {"env": {**os.environ, "PGPASSWORD": self.password}} if self.password else {}
        return {"user": "postgres", "group": "postgres", "extra_groups": [], **env} if self.as_root else env

    def _run(self, *argv: str) -> None:
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **self._as())

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [_pg_bin("postgres"), "-D", str(self.data), "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.folder}",
             "-c", "fsync=off", "-c", "max_connections=200"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **self._as(),
        )
        _wait_port(self.port, self.proc, "postgres")
        # The port opens before the cluster takes connections: wait for a real query.
        deadline = time.monotonic() + 30
        while True:
            done = subprocess.run([_pg_bin("psql"), "-h", "127.0.0.1", "-p", str(self.port),
                                   "-U", "postgres", "-c", "select 1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **self._as())
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("postgres took no connection within 30s")
            time.sleep(0.1)

    def database(self, name: str) -> str:
        self._run(_pg_bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                  "-c", f'create database "{name}"')
        return self._url(name)

    def stop(self, sig: int = signal.SIGINT) -> None:
        """SIGINT: PostgreSQL's fast shutdown."""
        if self.proc is not None:
            _stop(self.proc, sig)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
