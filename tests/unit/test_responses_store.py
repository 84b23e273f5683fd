"""The Responses API's store of responses (for previous_response_id and GET /v1/responses/{id}): the last
`max_stored` responses within `max_bytes` of their JSON, the oldest dropped first; one larger than the budget is
not kept."""

from __future__ import annotations

from pagedllm.entrypoints.openai.protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses, _Items


def test_the_store_keeps_the_last_responses_within_count_and_bytes() -> None:
    store = OpenAIServingResponses(chat=None, max_stored=3, max_bytes=2500)  # type: ignore[arg-type]
    request = ResponsesRequest(input="q")

    def put(i: int, text: str) -> None:
        items = _Items()
        items.add_text(text)
        store._store(request, {"id": f"resp_{i}", "output": items.items}, [{"role": "user", "content": "q"}], items)

    for i in range(5):
        put(i, "a")
    assert list(store.stored) == ["resp_2", "resp_3", "resp_4"]
    assert store.stored["resp_4"].conversation[-1] == {"role": "assistant", "content": "a"}
    put(5, "b" * 900)
    assert "resp_5" in store.stored and "resp_2" not in store.stored and store.stored_bytes <= 2500
    put(6, "c" * 5000)
    assert "resp_6" not in store.stored
    assert store.stored_bytes == sum(e.size for e in store.stored.values())
    unstored = ResponsesRequest(input="q", store=False)
    items = _Items()
    store._store(unstored, {"id": "resp_7", "output": []}, [], items)
    assert "resp_7" not in store.stored
