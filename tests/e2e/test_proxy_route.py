"""The proxy's prefill choice over real engines: kvloopd's Route answer decides it, and a dead directory
falls back to the load rule, saying so (header, metric).

The served stack has one prefill (prefix caching off) and two decodes (prefix caching on); a decode can
prefill too, so the proxy here is given the prefill and decode-1 as its prefill candidates: decode-1
holds a prompt in its prefix cache once it has computed it, the prefill never does."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvloop.clients.demo.conversation import AgentConversation, chat_turn
from kvloop.clients.directory_client import DirectoryClient
from kvloop.clients.fleet.model import random_text
from kvloop.clients.fleet.stack import _wait_http
from kvloop.clients.proxy.continuation import HISTORY_PREFIX_ROUTES
from kvloop.common.addresses import free_port
from kvloop.common.processes import supervisor
from kvloop.v1 import directory_pb2 as pb
from tests.e2e.test_proxy import MODEL, post
from tests.support import wait_until


@contextmanager
def routing_proxy(stack, daemon: str, log_dir: Path, *options: str) -> Iterator[str]:
    """`kvloop proxy --route` (or with `options`) with the prefill and decode-1 as prefill candidates,
    decode-0 decoding."""
    port = free_port()
    log = log_dir / f"proxy-{port}.log"
    prefill, warm = stack.prefill.config.url, stack.decodes[1].config.url
    command = [
        str(Path(sys.executable).parent / "kvloop"),
        "--daemon",
        daemon,
        "proxy",
        *(options or ("--route",)),
        "--route-timeout",
        "2",  # a loaded test host: the fallback is tested with a dead directory, not a slow one
        "--listen",
        f"127.0.0.1:{port}",
        "--prefill",
        prefill,
        "--prefill",
        warm,
        "--decode",
        stack.decodes[0].config.url,
    ]
    with log.open("w") as out:
        process = supervisor().spawn(command, stdout=subprocess.DEVNULL, stderr=out)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/health", process, log, 60)
        # both prefill candidates healthy (the proxy answers 200 once one of each role is)
        wait_until(
            lambda: all(b["healthy"] for b in json.loads(post_get(f"{url}/health"))["prefill"]),
            what="both prefill candidates healthy",
        )
        # the model's tokenizer loads in the background (until then the servers tokenize); importing
        # transformers alone took over 20 s on a busy 2-core host
        wait_until(
            lambda: json.loads(post_get(f"{url}/health"))["tokenizers"].get(MODEL, "").startswith("loaded"),
            timeout=120,
            what="the proxy's tokenizer loaded",
        )
        yield url
    finally:
        supervisor().stop(process, grace_s=10)


def post_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def chat(url: str, messages: list[dict]):
    with post(
        f"{url}/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0},
    ) as r:
        assert json.loads(r.read())["choices"][0]["message"]["content"] is not None
        return dict(r.headers)


def warmed_on(stack, server: str, seed: int, cache_salt: str = "") -> list[dict]:
    """A prompt `server` computed once (a plain request: its prefix cache holds it), once kvloopd's
    Route ranks `server` first for it (its BlockStored events indexed)."""
    messages = [{"role": "user", "content": random_text(600, seed)}]
    salted = {"cache_salt": cache_salt} if cache_salt else {}
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, **salted}
    with post(f"{server}/v1/chat/completions", body) as r:
        r.read()
    with post(f"{server}/tokenize", {"model": MODEL, "messages": messages}) as r:
        tokens = json.loads(r.read())["tokens"]
    candidates = [
        pb.RouteCandidate(http_endpoint=stack.prefill.config.url),
        pb.RouteCandidate(http_endpoint=server),
    ]
    with DirectoryClient(stack.daemon_address) as directory:

        def ranked_first() -> bool:
            answer = directory.route(MODEL, candidates, token_ids=tokens, cache_salt=cache_salt)
            return answer.ranked[0].http_endpoint == server and answer.ranked[0].local_blocks > 0

        wait_until(ranked_first, what="the warm server's BlockStored events indexed")
    return messages


def test_the_route_answer_decides_the_prefill(served_stack, tmp_path):
    warm = served_stack.decodes[1].config.url
    # Two prompts, each in decode-1's prefix cache only. (One prompt twice would not do: the first
    # turn leaves its KV retained on decode-0, and the prefill's pull of it ties with the cache.)
    prompts = [warmed_on(served_stack, warm, seed) for seed in (31, 39)]
    with routing_proxy(served_stack, served_stack.daemon_address, tmp_path) as proxy:
        # the load rule alternates between two idle candidates; Route sends both turns to the cache
        for messages in prompts:
            headers = chat(proxy, messages)
            assert headers["x-kvloop-route"] == "route", headers
            assert headers["x-kvloop-prefill"] == warm
            # no peer holds more than the warm cache: Route said so, and the prefill asked no Lookup
            assert (headers["x-kvloop-path"], headers["x-kvloop-reason"]) == ("local", "local_prefix")
            assert "Route found no peer" in headers["x-kvloop-detail"], headers
        metrics = post_get(f"{proxy}/metrics")
    assert 'kvloop_proxy_route_total{outcome="route"} 2.0' in metrics
    # the proxy tokenized both prompts itself (the model's directory is on this host)
    assert 'kvloop_proxy_tokenized_total{where="local"} 2.0' in metrics


def test_the_routing_benchs_prefix_arm_is_a_proxy_that_takes_the_own_prefix_and_never_pulls(
    served_stack, tmp_path
):
    """The routing bench's prefix_route arm: its turns go through a `kvloop proxy --route-by prefix
    --no-pull`. A turn goes to the candidate whose own cache holds its prompt; the next turn too,
    although decode-0 now retains the whole history and its answer: that prefill computes all its own
    cache lacks and pulls nothing. The bench's client reads the proxy's account of each turn."""
    from kvloop.clients.bench.multiturn.arms import ProxiedArmClient
    from kvloop.clients.bench.multiturn.setup import ROUTING_PROXY_OPTIONS, Session

    warm = served_stack.decodes[1].config.url
    arm = "prefix_route"
    messages = warmed_on(served_stack, warm, 43, cache_salt=f"kvloop-bench-{arm}")
    session = Session(seed=43, messages=messages)
    with routing_proxy(
        served_stack, served_stack.daemon_address, tmp_path, *ROUTING_PROXY_OPTIONS[arm]
    ) as proxy:
        client = ProxiedArmClient(arm, proxy)
        prompt = list(session.messages)
        first = client.turn(session, 16)
        session.messages += [
            {"role": "assistant", "content": first.answer},
            {"role": "user", "content": "Tool output: " + random_text(200, 44)},
        ]
        # decode-0 holds the first turn's run: a pull could serve the second turn's history
        assert served_stack.wait_turn_retained(prompt, cache_salt=client.salt)
        second = client.turn(session, 16)
    for turn in (first, second):
        assert (turn.route, turn.prefill_worker, turn.path) == ("prefix", warm, "local"), turn
        assert turn.pull_ms is None and 0 < turn.cached_tokens < turn.prompt_tokens == len(turn.prompt_ids)
        assert turn.route_ms is not None and turn.prefill_leg_ms is not None
        assert turn.prefill_leg_ms < turn.ttft_ms  # the first token comes from the decode, after the leg
        assert (
            turn.decode_stream is not None and turn.decode_stream.where == served_stack.decodes[0].config.url
        )
        # what the decode computed KV for: the prompt and the 16 answer tokens but the last
        assert turn.computed_ids[: turn.prompt_tokens] == turn.prompt_ids
        assert len(turn.computed_ids) == turn.prompt_tokens + 15
    # the second prompt starts with the first one and its answer, which warm computed only in part
    assert second.cached_tokens <= len(first.prompt_ids) < second.prompt_tokens


def test_a_dead_directory_falls_back_to_load(served_stack, tmp_path):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    messages = [{"role": "user", "content": random_text(200, 32)}]
    with routing_proxy(served_stack, dead, tmp_path) as proxy:
        chosen = set()
        for _ in range(2):
            headers = chat(proxy, messages)
            assert headers["x-kvloop-route"] == "load_unavailable", headers
            chosen.add(headers["x-kvloop-prefill"])
        metrics = post_get(f"{proxy}/metrics")
    # the load rule round-robins over the idle candidates
    assert chosen == {served_stack.prefill.config.url, served_stack.decodes[1].config.url}
    assert 'kvloop_proxy_route_total{outcome="load_unavailable"} 2.0' in metrics


def test_the_proxy_tokenizes_prompts_as_the_server_does(served_stack):
    """Route's token ids come from the model's tokenizer in the proxy's process (no /tokenize round
    trip per request); they are the ones vLLM's /tokenize gives for the same request, and a request it
    cannot render as vLLM would is left to the server."""
    from kvloop.clients.proxy.prompt_tokens import PromptTokenizer

    server = served_stack.prefill.config.url
    models = json.loads(post_get(f"{server}/v1/models"))["data"]
    tokenizer = PromptTokenizer(next(m["root"] for m in models if m["id"] == MODEL))
    history = [
        {"role": "system", "content": random_text(120, 33)},
        {"role": "user", "content": random_text(200, 34)},
        {"role": "assistant", "content": "<think>" + random_text(30, 35) + "</think> " + random_text(20, 36)},
        {"role": "user", "content": random_text(50, 37)},
    ]
    requests = [
        ({"messages": history[1:2]}, True),
        ({"messages": history}, True),
        ({"messages": history, "add_generation_prompt": False}, True),
        ({"prompt": random_text(300, 38)}, False),
    ]
    for request, chat in requests:
        body = {"model": MODEL, **request}
        with post(f"{server}/tokenize", body) as r:
            expected = json.loads(r.read())["tokens"]
        assert tokenizer.tokens(body, chat) == expected, request
    tool_call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    left_to_the_server = [
        {"messages": [*history, tool_call]},
        {"messages": history, "tools": [tool]},
        {"messages": [{"role": "developer", "content": "be brief"}, *history[1:]]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    ]
    for request in left_to_the_server:
        assert tokenizer.tokens({"model": MODEL, **request}, True) is None, request


def test_a_conversations_next_turn_is_routed_from_routes_answer_at_its_last(served_stack, tmp_path):
    """Agent turns through the routing proxy: when a turn ends the proxy asks Route about the
    conversation as it now stands, and the next turn is routed from that answer without tokenizing or
    asking Route, to a prefill where its history is found; each turn's answer equals a salted
    recompute's (which no cache or pull can serve). A turn that drops the first answer from the
    history is routed from the kept answer cut to the messages before it. A turn not streamed is kept
    for the next as a streamed one is, and its client gets no token ids it did not ask for."""
    conversation = AgentConversation(seed=47, system_words=400, tool_words=200)
    with routing_proxy(served_stack, served_stack.daemon_address, tmp_path) as proxy:
        routes, results = {}, []
        for turn in range(1, 7):
            if turn == 4:
                del conversation.messages[2]  # the first answer: every token after it shifts
            reference = chat_turn(
                proxy, MODEL, conversation.messages, 24, turn, extra={"cache_salt": f"ref-{uuid.uuid4()}"}
            )
            if turn == 5:
                body = {"model": MODEL, "messages": conversation.messages, "max_tokens": 24, "temperature": 0}
                with post(f"{proxy}/v1/chat/completions", body) as r:
                    plain, routes[turn] = json.loads(r.read()), r.headers["x-kvloop-route"]
                assert plain.get("prompt_token_ids") is None and plain["choices"][0].get("token_ids") is None
                answer = plain["choices"][0]["message"]["content"]
            else:
                result = chat_turn(proxy, MODEL, conversation.messages, 24, turn)
                answer, routes[turn] = result.answer, result.route
                results.append(result)
            assert answer == reference.answer, f"turn {turn}: the routed turn answered otherwise"
            conversation.record(answer)
            # the turn and its reference ended: Route's answer for each conversation kept (in the
            # background, after the proxy's delay)
            wait_until(
                lambda kept=2 * turn: (
                    _metric(proxy, 'kvloop_proxy_continuation_routes_total{outcome="kept"}') >= kept
                ),
                what="Route's answer kept for the conversation's next turn",
            )
        metrics = post_get(f"{proxy}/metrics")
    assert routes[1] in ("route", "tie")
    for turn in (2, 3, 5, 6):
        assert routes[turn] in ("continuation", "continuation_tie"), f"turn {turn}: {routes[turn]}"
    assert routes[4] in HISTORY_PREFIX_ROUTES
    for r in results[1:]:
        # the history (turn 4: its system and task messages) was found (own prefix cache or a peer's);
        # whether a short rest moves is the cost policy's call
        found = r.path in ("transfer", "local") or r.reason in ("below_threshold", "recompute_faster")
        assert found, f"turn {r.turn}: {r.path}/{r.reason} ({r.detail})"
    assert 'kvloop_proxy_continuation_routes_total{outcome="used"} 4.0' in metrics
    assert 'kvloop_proxy_continuation_routes_total{outcome="used_prefix"} 1.0' in metrics
    # tokenized: the first turn and the six salted references, not the continued or edited turns
    assert 'kvloop_proxy_tokenized_total{where="local"} 7.0' in metrics


def _metric(url: str, series: str) -> float:
    for line in post_get(f"{url}/metrics").splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
