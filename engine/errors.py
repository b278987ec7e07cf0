"""Engine errors.

    ValueError             bad input (the message names the field)
    EngineOverloaded       the waiting queue is at its request or token limit
"""

from __future__ import annotations


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; retry later. `limit` names the limit that was hit."""

    def __init__(self, message: str, *, limit: str, retry_after: float = 1.0):
        super().__init__(message)
        self.limit = limit
        self.retry_after = retry_after
