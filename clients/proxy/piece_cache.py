"""Rendered chat prompts tokenized piece by piece, the pieces between added tokens remembered.

A conversation is sent whole every turn; rendered, a long history is tens of milliseconds of BPE on
the router's path, all of it but the new messages done the turn before. A Hugging Face tokenizer
splits a text at its added tokens (``<|im_start|>``, ``<s>``...) before anything else and encodes
each piece between them on its own, so a piece's ids do not depend on its neighbours: encoding each
piece once and remembering it gives the ids of encoding the whole. That holds for added tokens that
take no neighbouring whitespace and match the raw text (no lstrip, rstrip, single_word or
normalized) and for pre-tokenizers that treat every piece alike (sentencepiece's Metaspace with
prepend_scheme "first" does not). ``PieceCache.for_tokenizer`` checks both at load, the second on
sample texts, and gives no cache when either fails.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any


class PieceCache:
    def __init__(self, tokenizer: Any, added: dict[str, int], max_chars: int) -> None:
        self._tokenizer = tokenizer
        self._added = added
        # Longest first: at one position the longest added token wins, as Hugging Face's matcher does.
        self._split = re.compile(
            "(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
        )
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, samples: Iterable[str], max_chars: int = 16 << 20
    ) -> PieceCache | None:
        """A cache for this tokenizer, or None when piece-wise encoding may differ from the whole."""
        tokens = list(tokenizer.added_tokens_decoder.values())
        if not tokens or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in tokens):
            return None
        cache = cls(
            tokenizer, {t.content: tokenizer.convert_tokens_to_ids(t.content) for t in tokens}, max_chars
        )
        for text in samples:
            if cache.encode(text) != list(tokenizer.encode(text, add_special_tokens=False)):
                return None
        cache.clear()
        return cache

    def encode(self, text: str) -> list[int]:
        """The text's ids, as ``tokenizer.encode(text, add_special_tokens=False)`` gives them."""
        out: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            added = self._added.get(piece)
            if added is not None:
                out.append(added)
            else:
                out.extend(self._piece(piece))
        return out

    def clear(self) -> None:
        with self._lock:
            self._pieces.clear()
            self._chars = 0
            self.hits = self.misses = 0

    def _piece(self, piece: str) -> array:
        with self._lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                self.hits += 1
                return ids
            self.misses += 1
        ids = array("I", self._tokenizer.encode(piece, add_special_tokens=False))
        with self._lock:
            if piece not in self._pieces and len(piece) <= self.max_chars:
                self._pieces[piece] = ids
                self._chars += len(piece)
                while self._chars > self.max_chars:  # least recently used out
                    old, _ = self._pieces.popitem(last=False)
                    self._chars -= len(old)
        return ids
