"""Fixtures shared across the test packages: an AWS API (moto server) per test module."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from moto.server import ThreadedMotoServer


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    """A moto server of the module's own (EC2, Auto Scaling, CloudWatch over real HTTP)."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def moto(moto_url: str) -> str:
    """The module's moto server, emptied for this test."""
    reset = urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST")  # noqa: S310  local http://
    with urllib.request.urlopen(reset, timeout=10) as resp:  # noqa: S310  a local http:// URL
        assert resp.status == 200
    return moto_url
