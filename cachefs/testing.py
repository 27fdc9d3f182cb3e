"""Helpers shared by the tests and the benchmarks: a real S3 endpoint (moto, server mode).

moto runs in its own process, as a real object store would, so that its CPU time (a few ms
per request) is not charged to the process under test. Needs the ``test`` extra.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from typing import Any

_MOTO_MAIN = r"""
import os, sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # runs until the parent closes our stdin (or dies)
server.stop()
"""

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}


def fake_s3_client(url: str) -> Any:
    """A boto3 S3 client for a moto endpoint, with its fake credentials."""
    import boto3

    return boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def new_fake_bucket(url: str, prefix: str) -> str:
    """A fresh bucket at a moto endpoint (botocore: s3fs's mkdir of a bucket fails on moto)."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    fake_s3_client(url).create_bucket(Bucket=name)
    return name


class MotoServer:
    """``with MotoServer() as s3: s3.endpoint_url`` — a moto S3 server on a free loopback port."""

    def __init__(self, key_buffer_size: int = 256 << 20) -> None:
        self.key_buffer_size = key_buffer_size
        self.proc: subprocess.Popen[str] | None = None
        self.endpoint_url = ""

    def start(self, timeout: float = 60.0) -> "MotoServer":
        env = dict(os.environ, **FAKE_CREDENTIALS)
        # Keep objects in memory rather than spooled to temp files (moto's default is ~5 MiB).
        env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(self.key_buffer_size)
        self.proc = subprocess.Popen([sys.executable, "-c", _MOTO_MAIN], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            self.stop()
            raise RuntimeError("moto server did not start (is the test extra installed?)")
        self.endpoint_url = f"http://127.0.0.1:{int(line)}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=5).read()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None

    def reset(self) -> None:
        req = urllib.request.Request(self.endpoint_url + "/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).read()

    def client(self) -> Any:
        return fake_s3_client(self.endpoint_url)

    def new_bucket(self, prefix: str = "cachefs-test") -> str:
        return new_fake_bucket(self.endpoint_url, prefix)

    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this endpoint: what a worker's S3 mount holds (credentials included)."""
        return {"key": "testing", "secret": "testing", "endpoint_url": self.endpoint_url,
                "client_kwargs": {"region_name": "us-east-1"}}

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
