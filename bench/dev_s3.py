"""An S3 server for the tests and the benchmarks: moto's standalone server (`python -m moto.server`) in a process
of its own on a free loopback port, speaking the S3 wire protocol (conditional writes included) over HTTP, and
the AWS environment a client needs to reach it. A process, not moto's ThreadedMotoServer: a thread would share
the GIL with the compiles a test runs in-process, and answer them late under load. It dies with the process
that started it (bench.dev_redis.die_with_parent)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid

import boto3

from bench.dev_redis import START_TIMEOUT_SECONDS, die_with_parent, free_loopback_port

REGION = "us-east-1"
KEY = "nkicache-tests"  # moto takes any credentials


class S3Server:
    """One server; every bucket it makes is new."""

    def __init__(self, attempts: int = 3) -> None:
        for _ in range(attempts):  # another process may take the free port between the look and the bind
            port = free_loopback_port()
            command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
            self.process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
            )
            if _answers(port, self.process):
                break
            self.stop()
        else:
            raise RuntimeError(f"moto's S3 server did not start on loopback in {attempts} attempts")
        self.endpoint = f"http://127.0.0.1:{port}"
        self.environment = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": KEY,
            "AWS_DEFAULT_REGION": REGION,
        }
        self.client = boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=KEY, aws_secret_access_key=KEY
        )

    def new_bucket(self) -> str:
        name = f"nkicache-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(Bucket=name)
        return name

    def object_names(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def stop(self) -> None:
        """Kill the server (what a test that stops it mid-compile wants too)."""
        self.process.kill()
        self.process.wait()


def _answers(port: int, process: subprocess.Popen) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline and process.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False
