"""The `redis_server` fixture: a real redis-server (bench/redis_server.py) with AOF
`always`, in the test's temp dir, that a test may stop, kill and start again."""

from __future__ import annotations

import pytest

from bench.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    """A started RedisServer, stopped at the end of the test."""
    server = RedisServer(tmp_path)
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()
