"""Request logs for `kvloop bench replay`: the Mooncake trace format and OpenAI-style chat logs,
turned into what the simulated fleet needs: each request's vLLM block hashes.

Mooncake traces (one JSON object per line: ``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids``) name each 512-token block of the prompt by an id; equal ids mean equal prefixes. The
tokens are not in the trace, so each trace block stands for ``trace_block_size / block_size`` vLLM
blocks whose chained hashes vLLM's own ``hash_block_tokens`` computes over placeholder tokens
``(hash_id, j)``. Reuse is therefore seen at the trace's granularity: the first vLLM blocks of a
partly filled last trace block never match a longer prompt (the trace cannot say they would).

Chat logs (one request per line: ``messages``, optional ``timestamp`` in ms or an ISO date,
``session_id``, ``output_length`` / ``max_tokens``) are rendered with the tokenizer's chat template
and hashed over the real token ids, exactly as a vLLM engine with ``sha256_cbor`` would.

What a decode holds after a turn (prompt plus answer) is known for the answer only when a later turn
of the same session resends it: the decode's held blocks are then the next turn's blocks up to the
turn's own length, as long as that turn extends this one (see :func:`link_sessions`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kvloop.common.tokens import agreeing_prefix_length

MOONCAKE_BLOCK_SIZE = 512


class TraceError(ValueError):
    """A trace line the replay cannot use; the message names the file and line."""


@dataclass(slots=True)
class TraceRequest:
    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    # vLLM chained hashes of the prompt's full blocks.
    hashes: list[bytes]
    # Leading hashes whose identity carries into a longer prompt sharing this prefix (all of them for
    # real tokens; the full trace blocks' for a Mooncake trace).
    certain_blocks: int
    session: str | None = None
    # What the decode holds after the turn, by hash (filled by link_sessions).
    held: list[bytes] = field(default_factory=list)

    @property
    def held_tokens(self) -> int:
        """Tokens of KV the decode keeps for the turn (prompt and answer, the last sampled token
        excluded: its KV is never computed)."""
        return max(0, self.input_length + self.output_length - 1)


class VllmBlockHasher:
    """vLLM's chained block hashes (``hash_block_tokens`` with ``sha256_cbor``, vLLM's NONE_HASH
    seeded by PYTHONHASHSEED like every engine's)."""

    def __init__(self, block_size: int) -> None:
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core import kv_cache_utils

        kv_cache_utils.init_none_hash(sha256_cbor)
        self.block_size = block_size
        self._hash_fn = sha256_cbor
        self._hash_block = kv_cache_utils.hash_block_tokens
        self._trace_cache: dict[tuple[bytes | None, int, int], list[bytes]] = {}

    def tokens(self, token_ids: list[int]) -> list[bytes]:
        bs, parent, out = self.block_size, None, []
        for i in range(len(token_ids) // bs):
            parent = self._hash_block(self._hash_fn, parent, token_ids[i * bs : (i + 1) * bs])
            out.append(bytes(parent))
        return out

    def trace_blocks(self, hash_ids: list[int], input_length: int, trace_block_size: int) -> list[bytes]:
        """The vLLM block hashes of a Mooncake prompt, cached per (parent, trace block)."""
        per = trace_block_size // self.block_size
        out: list[bytes] = []
        parent: bytes | None = None
        for i, hid in enumerate(hash_ids):
            covered = min(trace_block_size, input_length - i * trace_block_size)
            n = min(per, covered // self.block_size)
            if n <= 0:
                break
            key = (parent, hid, n)
            sub = self._trace_cache.get(key)
            if sub is None:
                sub, p = [], parent
                for j in range(n):
                    p = bytes(self._hash_block(self._hash_fn, p, (hid, j)))  # type: ignore[arg-type]
                    sub.append(p)
                self._trace_cache[key] = sub
            out.extend(sub)
            parent = sub[-1]
        return out


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc.strerror})") from None
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
            yield number, obj


def _int(obj: dict, key: str, where: str, minimum: int) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _timestamp_ms(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp() * 1000
        except ValueError:
            pass
    raise TraceError(f"{where}: 'timestamp' must be milliseconds or an ISO 8601 date, got {value!r}")


def detect_format(path: Path) -> str:
    """``mooncake`` when the first object has ``hash_ids``, ``chat`` when it has messages."""
    for number, obj in _lines(path):
        if "hash_ids" in obj:
            return "mooncake"
        if "messages" in _chat_body(obj):
            return "chat"
        raise TraceError(
            f"{path}:{number}: neither a Mooncake record (hash_ids, input_length, ...) nor a chat "
            "request (messages); give --format"
        )
    raise TraceError(f"{path}: the trace is empty")


def read_mooncake(
    path: Path, hasher: VllmBlockHasher, trace_block_size: int = MOONCAKE_BLOCK_SIZE
) -> list[TraceRequest]:
    if trace_block_size % hasher.block_size:
        raise TraceError(
            f"the trace's block size {trace_block_size} is not a multiple of the vLLM block size "
            f"{hasher.block_size}"
        )
    per = trace_block_size // hasher.block_size
    out: list[TraceRequest] = []
    for number, obj in _lines(path):
        where = f"{path}:{number}"
        timestamp = _timestamp_ms(obj.get("timestamp"), where)
        if timestamp is None:
            raise TraceError(f"{where}: missing 'timestamp' (milliseconds)")
        input_length = _int(obj, "input_length", where, 1)
        output_length = _int(obj, "output_length", where, 0)
        hash_ids = obj.get("hash_ids")
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
        ):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
        if len(hash_ids) < input_length // trace_block_size:
            raise TraceError(
                f"{where}: {len(hash_ids)} hash_ids cannot cover input_length {input_length} at "
                f"{trace_block_size} tokens per block (--trace-block-size)"
            )
        hashes = hasher.trace_blocks(hash_ids, input_length, trace_block_size)
        session = obj.get("session_id")
        out.append(
            TraceRequest(
                index=len(out),
                timestamp_ms=timestamp,
                input_length=input_length,
                output_length=output_length,
                hashes=hashes,
                certain_blocks=(input_length // trace_block_size) * per,
                session=str(session) if session is not None else None,
            )
        )
    return out


def _chat_body(obj: dict[str, Any]) -> dict[str, Any]:
    """Logs wrap the request differently: the object itself, or under ``request`` / ``body``."""
    for key in ("request", "body"):
        inner = obj.get(key)
        if isinstance(inner, dict) and "messages" in inner:
            return inner
    return obj


class ChatTokenizer:
    """A local tokenizer (path or cached name) rendering messages with its chat template."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(name)
        except Exception as exc:  # transformers raises OSError, ValueError, HF hub errors...
            raise TraceError(f"cannot load tokenizer {name!r}: {str(exc).splitlines()[0]}") from None
        if not getattr(self._tokenizer, "chat_template", None):
            raise TraceError(f"tokenizer {name!r} has no chat template to render the messages with")

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        # As vLLM's chat endpoint does: render the template to text, tokenize without adding
        # special tokens (the template has them).
        text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(str(text))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def read_chat(path: Path, hasher: VllmBlockHasher, tokenizer: str) -> list[TraceRequest]:
    chat = ChatTokenizer(tokenizer)
    rows: list[tuple[str, float | None, str | None, list[dict], int | None, int | None]] = []
    for number, obj in _lines(path):
        where = f"{path}:{number}"
        body = _chat_body(obj)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise TraceError(f"{where}: 'messages' must be a non-empty list of message objects")
        timestamp = _timestamp_ms(obj.get("timestamp", body.get("timestamp")), where)
        session = obj.get("session_id", body.get("session_id", obj.get("conversation_id")))
        explicit = obj.get("output_length")
        if explicit is not None:
            explicit = _int(obj, "output_length", where, 0)
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        cap = cap if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0 else None
        rows.append(
            (where, timestamp, str(session) if session is not None else None, messages, explicit, cap)
        )
    if any(r[1] is None for r in rows) and not all(r[1] is None for r in rows):
        first = next(r for r in rows if r[1] is None)
        raise TraceError(f"{first[0]}: a timestamp is missing (give every request one, or none)")
    out: list[TraceRequest] = []
    by_session: dict[str, int] = {}  # session -> index of its latest request in `out`
    for i, (where, timestamp, session, messages, explicit, cap) in enumerate(rows):
        try:
            tokens = chat.render(messages)
        except Exception as exc:  # a template error names the message it choked on
            raise TraceError(f"{where}: the chat template failed: {str(exc).splitlines()[0]}") from None
        request = TraceRequest(
            index=i,
            timestamp_ms=timestamp if timestamp is not None else i * 1000.0,
            input_length=len(tokens),
            output_length=explicit if explicit is not None else (cap or 0),
            hashes=hasher.tokens(tokens),
            certain_blocks=0,
            session=session,
        )
        request.certain_blocks = len(request.hashes)
        if session is not None and session in by_session and explicit is None:
            # The previous turn's answer is the assistant message this turn resends after it.
            prev = out[by_session[session]]
            answer = next(
                (m for m in messages[_message_count(rows, prev.index) :] if m.get("role") == "assistant"),
                None,
            )
            if answer is not None and isinstance(answer.get("content"), str):
                prev.output_length = len(chat.encode(answer["content"])) + 1  # and its end-of-turn token
        if session is not None:
            by_session[session] = len(out)
        out.append(request)
    return out


def _message_count(rows: list, index: int) -> int:
    return len(rows[index][3])


def link_sessions(requests: list[TraceRequest], block_size: int) -> None:
    """Fill each request's ``held`` hashes: its prompt's blocks, and its answer's blocks where the
    session's next turn resends them (the next prompt extends this one over its certain blocks)."""
    last: dict[str, TraceRequest] = {}
    for r in sorted(requests, key=lambda r: (r.timestamp_ms, r.index)):
        r.held = list(r.hashes[: r.held_tokens // block_size])
        if r.session is None:
            continue
        prev = last.get(r.session)
        last[r.session] = r
        if prev is None:
            continue
        common = agreeing_prefix_length(prev.hashes, r.hashes)
        if common >= prev.certain_blocks:
            prev.held = (prev.hashes[:common] + r.hashes[common:])[: prev.held_tokens // block_size]


def read_trace(
    path: Path,
    block_size: int,
    fmt: str = "auto",
    tokenizer: str | None = None,
    trace_block_size: int = MOONCAKE_BLOCK_SIZE,
    limit: int | None = None,
) -> list[TraceRequest]:
    """Read, hash, order by time (stable), keep the first ``limit`` and link sessions."""
    hasher = VllmBlockHasher(block_size)
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "mooncake":
        requests = read_mooncake(path, hasher, trace_block_size)
    elif fmt == "chat":
        if not tokenizer:
            raise TraceError(f"{path}: a chat log needs --tokenizer (a local tokenizer directory or name)")
        requests = read_chat(path, hasher, tokenizer)
    else:
        raise TraceError(f"unknown trace format {fmt!r}: mooncake, chat or auto")
    requests.sort(key=lambda r: (r.timestamp_ms, r.index))
    if limit is not None:
        requests = requests[:limit]
    for i, r in enumerate(requests):
        r.index = i
    link_sessions(requests, block_size)
    return requests


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, separators=(",", ":")) + "\n")
