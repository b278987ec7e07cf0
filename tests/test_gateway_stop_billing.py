"""Issue 25 item 11: a request still streaming when the engine stops is billed what it
produced, not 0 (AsyncEngine.stop's final outputs carry no counts of their own)."""

from __future__ import annotations

import pytest

from engine import RequestOutput
from gateway.streaming import Delta, Failed
from tests.live import FakeClock
from tests.fake_engine import FakeEngine
from tests.test_chat_service import HELLO, events_of, service


class StoppingEngine(FakeEngine):
    """Streams its script, then ends the request as AsyncEngine.stop() does."""

    async def generate(self, rid, prompt, params, *, priority, tenant, deadline, weight, validated, on_final):
        produced = 0
        for n, text in self.script:
            produced += n
            yield RequestOutput(rid, [7] * n, text, False, None, len(prompt), produced)
        out = RequestOutput(rid, [], "", True, "abort", error="engine stopped")
        on_final(out)
        yield out


@pytest.mark.parametrize("script", [[(1, "a"), (2, "bc")], []])
async def test_a_request_cut_by_the_engine_stopping_is_billed_what_it_produced(tmp_path, script):
    chat, acme = service(StoppingEngine(script), FakeClock(), tmp_path)
    adm = await chat.admit(acme, {"messages": HELLO}, transport="sse")
    events = await events_of(chat, adm)
    produced = sum(n for n, _ in script)
    assert sum(e.num_tokens for e in events if isinstance(e, Delta)) == produced
    assert not isinstance(events[-1], Failed) or produced == 0
    billed = chat.admitter.quotas.ledger.used_today("acme")
    assert billed == (len(adm.prompt_ids) + produced if produced else 0)
