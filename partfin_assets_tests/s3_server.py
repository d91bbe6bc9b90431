"""An S3-compatible server on loopback for the tests: moto's server mode in a process of its own, stopped by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ACCESS_KEY = "partfin-test"
SECRET_KEY = "partfin-test-secret"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> S3Server:
        server = Path(sys.executable).with_name("moto_server")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(server), "-H", "127.0.0.1", "-p", str(self.port)], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited: {self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2)
                return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.endpoint} within {timeout}s")

    def create_bucket(self, name: str) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name=REGION)
        client.create_bucket(Bucket=name)

    def keys(self, bucket: str) -> list[str]:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name=REGION)
        out: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        self.proc = None
