"""Text with characters that Python's str.splitlines() takes for line ends (U+2028, U+2029,
U+0085) streams intact to a client that reads SSE with httpx's iter_lines, as GuideLLM does:
every `data:` line is whole JSON, over chat, completions and responses, through a real
uvicorn. (Raw in a data line, such a character cut it: GuideLLM counted the request as
failed, found in a benchmark run on 2026-12-05.)"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fake_engine import FakeEngine
from tests.live import KEYS, serve

PIECES = ["one\u2028", "two\u2029three", "\x85four", " caf\u00e9\n"]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with serve("fake", tmp_path_factory.mktemp("line-breaks"), engine=FakeEngine([(1, p) for p in PIECES])) as server:
        yield server


def data_lines(live, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{live.url}{path}", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEYS['acme']}"}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]        # raises on a cut line


@pytest.mark.parametrize("path, body, text_of", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
     lambda e: "".join(c["delta"].get("content") or "" for c in e.get("choices", []))),
    ("/v1/completions", {"prompt": "x"}, lambda e: "".join(c["text"] for c in e.get("choices", []))),
    ("/v1/responses", {"input": "x"}, lambda e: e.get("delta", "") if e["type"] == "response.output_text.delta" else ""),
])
def test_line_break_characters_stream_as_whole_json_lines(live, path, body, text_of):
    events = data_lines(live, path, {"model": "tiny", "stream": True, "max_tokens": 20, **body})
    assert "".join(text_of(e) for e in events) == "".join(PIECES)
