"""An S3 server for the tests and the benchmarks: moto's standalone server (`ThreadedMotoServer`) on a free
loopback port, speaking the S3 wire protocol (conditional writes included) over HTTP, and the AWS environment a
client needs to reach it."""

from __future__ import annotations

import uuid

import boto3
from moto.server import ThreadedMotoServer

REGION = "us-east-1"


class S3Server:
    """One server; every bucket it makes is new."""

    def __init__(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.environment = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "nkicache-tests",
            "AWS_SECRET_ACCESS_KEY": "nkicache-tests",
            "AWS_DEFAULT_REGION": REGION,
        }
        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id="nkicache-tests",
            aws_secret_access_key="nkicache-tests",
        )

    def new_bucket(self) -> str:
        name = f"nkicache-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(Bucket=name)
        return name

    def object_names(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def stop(self) -> None:
        self.server.stop()
