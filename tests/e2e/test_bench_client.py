"""The multiturn benchmark's streamed decode against a real served engine: the per-turn decode TPOT it
reports comes from an answer identical to the whole (not streamed) one."""

from __future__ import annotations

from kvloop.clients.bench.multiturn import MODEL, _post, _stream_chat


def test_a_streamed_answer_matches_the_whole_one_and_times_every_token(served_stack):
    url = f"{served_stack.decodes[0].config.url}/v1/chat/completions"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "list the tools you have and what each one does"}],
        "temperature": 0.0,
        "return_token_ids": True,
        "max_tokens": 24,
        "ignore_eos": True,
    }
    whole = _post(url, body)
    streamed = _stream_chat(url, body)
    choice = whole["choices"][0]
    assert streamed.token_ids == choice["token_ids"] and len(streamed.token_ids) == 24
    assert streamed.content == choice["message"]["content"]
    assert streamed.prompt_token_ids == whole["prompt_token_ids"]
    assert streamed.tpot_ms is not None and streamed.tpot_ms > 0
