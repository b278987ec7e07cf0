"""`streamgate` whose engine holds long streams (tests/held_engine.py, `long_held`), for
tests that run real `streamgate serve` processes and need a stream that outlasts a wait
(a second request, a disconnect, a kill) whatever this host's speed:

    python -m tests.held_serve serve --model ... (the same arguments as `streamgate`)

A request asking for at least 1000 tokens stops producing after 16 until it is aborted;
everything else is the real command. Test-only: it swaps `engine.AsyncEngine`, which the
gateway imports when it builds its engine, before the command runs.
"""

from __future__ import annotations

import sys

import engine
from engine import EngineConfig
from tests.held_engine import HeldEngine, long_held


class LongHeldEngine(HeldEngine):
    def __init__(self, config: EngineConfig):
        super().__init__(config, steps=None, hold_when=long_held())


if __name__ == "__main__":
    engine.AsyncEngine = LongHeldEngine
    from gateway.cli import main

    sys.exit(main())
