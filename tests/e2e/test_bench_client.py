"""The multiturn benchmark's streamed decode against a real served engine: the per-turn decode TPOT it
reports comes from an answer identical to the whole (not streamed) one."""

from __future__ import annotations

import urllib.request

from kvloop.clients.bench.multiturn.arms import _post, _stream_chat
from kvloop.clients.bench.multiturn.setup import MODEL


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
    # the chunk times the decode's steps are taken from: one per chunk that carried tokens, in order
    assert streamed.stream is not None and sum(streamed.stream.tokens) == 24
    assert streamed.stream.times == sorted(streamed.stream.times)


def test_a_decode_request_can_decline_retention(served_stack, tmp_path):
    """`kvloop_retain: false` (what `kvloop bench decode-tpot`'s no-retention conditions send): the decode
    frees the request's blocks at once and announces nothing; the same request without it is retained."""
    from kvloop.clients.bench.decode_tpot import DecodeTpotConfig, Driver
    from kvloop.clients.bench.multiturn.arms import engine_totals
    from tests.support import wait_until

    decode_url = served_stack.decodes[0].config.url
    series = {"kvloop_connector_retained_runs_total": "retained"}

    def retained() -> float:
        page = urllib.request.urlopen(f"{decode_url}/metrics", timeout=10).read().decode()
        return engine_totals(page, series)["retained"]

    driver = Driver(served_stack.prefill.config.url, decode_url, DecodeTpotConfig(tmp_path, prompt_tokens=96))
    before = retained()
    for retain in (False, True):  # the retained one last: once it shows, the declined one had its chance
        prompt = driver.prompt()
        stream, ids = driver.decode(prompt, driver.prefill(prompt), retain, 0.0)
        assert len(ids) == driver.cfg.answer_tokens and len(stream.times) == len(stream.tokens)
    wait_until(lambda: retained() > before, timeout=15)
    assert retained() == before + 1


def test_a_traced_turn_is_taken_apart_from_the_spans_of_every_process_that_served_it(
    served_stack, otlp_receiver
):
    """`bench multiturn --spans`: each turn sends a trace context of its own, and its parts come from
    the spans the prefill's vLLM, its connector and the decode exported under it."""
    from kvloop.clients.bench.multiturn.arms import ArmClient
    from kvloop.clients.bench.multiturn.breakdown import turn_parts
    from kvloop.clients.bench.multiturn.setup import Session, TurnSample
    from tests.support import wait_until

    client = ArmClient(
        "kvloop",
        served_stack.prefill.config.url,
        served_stack.decodes[0].config.url,
        traced=True,
        stream_decodes=False,
    )
    history = "the agent's tools answered " + " ".join(f"result {i} of the span test" for i in range(60))
    session = Session(seed=9071, messages=[{"role": "user", "content": history}])
    first = client.turn(session, max_tokens=8)
    assert served_stack.wait_turn_retained(session.messages)
    session.messages += [
        {"role": "assistant", "content": first.answer},
        {"role": "user", "content": "and then " + " ".join(f"more output {i}" for i in range(20))},
    ]
    second = client.turn(session, max_tokens=8)
    assert second.path == "transfer" and second.trace_id and second.trace_id != first.trace_id

    def traced() -> list[dict]:
        return [s for s in otlp_receiver.spans() if s.get("trace_id") == second.trace_id]

    # the prefill's and the decode's request spans, and the connector's READ (each exported in batches)
    wait_until(lambda: {"kvloop.nixl_read", "kvloop.lookup"} <= {s["name"] for s in traced()})
    wait_until(lambda: sum(s["name"] == "llm_request" for s in traced()) == 2)
    sample = TurnSample("kvloop", "plain", 1, 0, 2, second.prompt_tokens, second.ttft_ms, 0, second.path, "")
    sample.trace_id = second.trace_id
    parts = turn_parts(sample, traced())
    assert parts is not None and "decode_first" in parts
    assert parts["lookup"] > 0 and parts["read"] > 0 and parts["compute"] > 0
    # the READ and the lookup happen while the request waits in vLLM's queue
    assert parts["queue"] >= parts["read"] and parts["ttft"] >= parts["queue"] + parts["compute"] - 1.0
