"""A throwaway PostgreSQL 15 cluster for tests: initdb in a temp dir, a free loopback port, stop by PID.

Debian's server binaries come from `pg_config --bindir`. initdb refuses to run as root, so as
root the cluster runs as the `postgres` system user.

`settings` adds server settings (`name=value`). `fake_clock` runs the server -- and only the
server, not pg_ctl -- under libfaketime (Debian: `faketime`) with that FAKETIME spec, e.g.
`"@2026-11-01 00:55:00 x120"`: its clock starts at that time when the postmaster starts and
runs 120 times faster, so commit timestamps cross hour boundaries within a test. `clock_file`
instead reads the offset from a file on every clock call (libfaketime's FAKETIME_TIMESTAMP_FILE,
e.g. `-30s`), so a test can step the server's clock back while it runs (a failover, an NTP step).
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PostgresCluster:
    host: str
    port: int
    user: str
    data_dir: Path
    pid: int

    def dsn(self, database: str = "postgres") -> str:
        return f"host={self.host} port={self.port} user={self.user} dbname={database}"

    def sqlalchemy_uri(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{self.user}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')


def postgres_bindir() -> Path | None:
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        return None
    bindir = Path(subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=True).stdout.strip())
    return bindir if (bindir / "initdb").exists() else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _knows_setting(bindir: Path, name: str) -> bool:
    described = subprocess.run([str(bindir / "postgres"), "--describe-config"], capture_output=True, text=True)
    return any(line.split("\t", 1)[0] == name for line in described.stdout.splitlines())


def _as_cluster_user(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@contextmanager
def throwaway_cluster(
    *, logical: bool = True, settings: Sequence[str] = (), fake_clock: str | None = None, clock_file: Path | None = None
) -> Iterator[PostgresCluster]:
    bindir = postgres_bindir()
    if bindir is None:
        raise RuntimeError("PostgreSQL server binaries not found: install Debian's postgresql-15 (pg_config --bindir)")
    # directly under /tmp: pytest's own temp dirs are private to root, the cluster user must reach it
    root = Path(tempfile.mkdtemp(prefix="partfin-pg-"))
    data_dir = root / "pgdata"
    socket_dir = root / "sock"
    socket_dir.mkdir(exist_ok=True)
    user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() == 0:
        for path in (root, socket_dir):
            shutil.chown(path, "postgres", "postgres")
    _run(_as_cluster_user([str(bindir / "initdb"), "-D", str(data_dir), "-U", user, "--auth=trust", "-E", "UTF8", "--no-sync"]))
    port = free_port()
    options = [
        f"-c port={port}", "-c listen_addresses=127.0.0.1", f"-c unix_socket_directories={socket_dir}",
        "-c fsync=off", "-c max_connections=100",
    ]
    if logical:
        options += ["-c wal_level=logical", "-c max_replication_slots=10", "-c max_wal_senders=10"]
        if _knows_setting(bindir, "output_plugin_libraries"):
            # PostgreSQL 15.20+ (CVE-2026-6471) loads only listed output plugins; older servers refuse the name
            options += ["-c output_plugin_libraries=pgoutput,test_decoding,wal2json"]
    options += [f"-c {setting}" for setting in settings]
    # pg_ctl -w compares the start time in postmaster.pid with its own clock: under a fake clock, wait here
    faked = fake_clock is not None or clock_file is not None
    server = ["-W", "-p", _fake_clock_wrapper(root, bindir, fake_clock, clock_file)] if faked else ["-w"]
    _run(_as_cluster_user([str(bindir / "pg_ctl"), "-D", str(data_dir), "-l", str(root / "server.log"), *server,
                           "-o", " ".join(options), "start"]))
    pid = _wait_ready(data_dir, root / "server.log") if faked else int((data_dir / "postmaster.pid").read_text().splitlines()[0])
    try:
        yield PostgresCluster("127.0.0.1", port, user, data_dir, pid)
    finally:
        stop_by_pid(pid)
        shutil.rmtree(root, ignore_errors=True)


def _wait_ready(data_dir: Path, log: Path, timeout_s: float = 60.0) -> int:
    """The postmaster's PID once postmaster.pid says `ready`; stopped and an error after timeout_s (real time)."""
    deadline = time.monotonic() + timeout_s
    pid = None
    while time.monotonic() < deadline:
        try:
            lines = (data_dir / "postmaster.pid").read_text().splitlines()
        except FileNotFoundError:
            lines = []
        if lines:
            pid = int(lines[0])
            if len(lines) >= 8 and lines[7].strip() == "ready":
                return pid
        time.sleep(0.1)
    if pid is not None:
        stop_by_pid(pid)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"PostgreSQL did not become ready within {timeout_s:.0f}s:\n{tail}")


def libfaketime() -> Path | None:
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1", "/usr/local/lib/faketime/libfaketime.so.1"):
        found = sorted(Path("/").glob(pattern.lstrip("/")))
        if found:
            return found[0]
    return None


def _fake_clock_wrapper(root: Path, bindir: Path, spec: str | None, clock_file: Path | None = None) -> str:
    """An executable that starts `postgres` under libfaketime (pg_ctl -p), so pg_ctl keeps the real clock."""
    library = libfaketime()
    if library is None:
        raise RuntimeError("libfaketime not found: install Debian's faketime package (apt-get install faketime)")
    if clock_file is not None:
        clock = f"FAKETIME_TIMESTAMP_FILE={shlex.quote(str(clock_file))} FAKETIME_NO_CACHE=1"
    else:
        clock = f"FAKETIME={shlex.quote(spec or '+0')}"
    wrapper = root / "postgres-faketime"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"export LD_PRELOAD={shlex.quote(str(library))} {clock}\n"
        f'exec {shlex.quote(str(bindir / "postgres"))} "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}")


def stop_by_pid(pid: int, timeout_s: float = 30.0) -> None:
    """Fast shutdown (SIGINT to the postmaster), then SIGKILL if it does not go."""
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
