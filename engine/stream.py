"""One request's mailbox on the event loop (AsyncEngine's collector)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .sequence import RequestOutput

log = logging.getLogger("streamgate.engine")


class Collector:
    """Holds at most one (merged) output, or the engine thread's refusal of the request.

    `deliver` is how an output arrives: a final one goes to `on_final` first (exactly once,
    even when the consumer has left), and nothing after a final one is taken."""

    __slots__ = ("output", "event", "detached", "on_final", "refused", "ended")

    def __init__(self, on_final: Callable[[RequestOutput], None] | None) -> None:
        self.output: RequestOutput | None = None
        self.event = asyncio.Event()
        self.detached = False    # the consumer left; kept until the engine confirms the end
        self.on_final = on_final
        self.refused: Exception | None = None
        self.ended = False       # a final output arrived

    def deliver(self, out: RequestOutput) -> None:
        if self.ended:
            return
        if out.finished:
            self.ended = True
            on_final, self.on_final = self.on_final, None
            if on_final is not None:
                try:
                    on_final(out)
                except Exception:
                    log.exception("on_final callback failed for %s", out.request_id)
        if not self.detached:
            self.output = out if self.output is None else self.output.merge(out)
            self.event.set()

    def refuse(self, exc: Exception) -> None:
        """The engine thread refused the request: it was never queued (no on_final)."""
        self.refused = exc
        self.ended = True
        self.on_final = None
        self.event.set()

    async def get(self) -> RequestOutput:
        await self.event.wait()
        self.event.clear()
        if self.refused is not None:
            raise self.refused
        out, self.output = self.output, None
        return out
