"""The `redis_server` fixture: a real redis-server (bench/redis_server.py) with AOF
`always`, in the test's temp dir, that a test may stop, kill and start again."""

from __future__ import annotations

import pytest

from bench.redis_server import RedisServer


def started(path):
    """A RedisServer started in `path` (the test fails if it cannot start), stopped after."""
    server = RedisServer(path)
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


def wait_healthy(url: str, proc, timeout_s: float, describe=lambda: "did not come up") -> None:
    """Poll `url`/health until it answers 200; fail if `proc` exits or `timeout_s` passes."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, f"{url}: {describe()}"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@pytest.fixture
def redis_server(tmp_path):
    """A started RedisServer, stopped at the end of the test."""
    yield from started(tmp_path)
