"""Fixtures shared across the test packages: an AWS API (moto server) per test module, each starting
from an empty AWS state. The modules that run real Prometheus, Alertmanager or a deployed control plane
(marked `e2e`) are collected first, so that `make test`'s workers (pytest-xdist, one module at a
time per worker) start with the longest and finish together."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from moto.server import ThreadedMotoServer


def reset_moto(url: str) -> None:
    """Empties every moto backend. They live in this process, not in the server: a module's own server
    still sees what an earlier module's server made, unless the state is reset."""
    reset = urllib.request.Request(f"{url}/moto-api/reset", method="POST")  # noqa: S310  local http://
    with urllib.request.urlopen(reset, timeout=10) as resp:  # noqa: S310  a local http:// URL
        assert resp.status == 200


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with an e2e test first; the order within a module, and otherwise, is kept (a stable
    sort on the module), since a module's tests may build on the ones before them."""
    heavy = {item.path for item in items if item.get_closest_marker("e2e")}
    items.sort(key=lambda item: item.path not in heavy)


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    """A moto server of the module's own (EC2, Auto Scaling, CloudWatch over real HTTP), empty at the
    start of the module and emptied again at its end."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    try:
        reset_moto(url)
        yield url
        reset_moto(url)
    finally:
        server.stop()


@pytest.fixture
def moto(moto_url: str) -> str:
    """The module's moto server, emptied for this test."""
    reset_moto(moto_url)
    return moto_url
