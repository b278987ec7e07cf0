"""What one request or socket has taken, released in one place, once, whatever the
transport does (docs/PROTOCOL.md, "Resources").

A handler that takes something (a stats subscription, a stats place, a socket place, a
stream entry, a lease) registers its release here at the moment it takes it. The owner
of the request (the response's `__call__`, the socket's `serve`) runs `release()` in its
own `finally`, which runs for HEAD, for a body never started, for a task cancelled
before it began and for a write that hit its deadline. Releases never live in a body
generator's or a spawned task's `finally`: those are exactly the ones that do not run
when the transport ends early.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import structlog

log = structlog.get_logger("streamgate.gateway")


class Holds:
    def __init__(self) -> None:
        self._releases: list[Callable[[], object]] = []
        self.released = False

    def take(self, release: Callable[[], object]) -> None:
        """Register the release of something just taken (sync or async callable)."""
        if self.released:       # taken after the owner finished: give it back at once
            raise RuntimeError("the request's resources were already released")
        self._releases.append(release)

    async def release(self) -> None:
        """Run every release, newest first, exactly once; one failing does not stop the rest."""
        if self.released:
            return
        self.released = True
        while self._releases:
            fn = self._releases.pop()
            try:
                result = fn()
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:        # noqa: BLE001 - the others must still run
                log.error("release.failed", error=type(exc).__name__)
