"""A request's prompt as token ids, rendered and tokenized in the router's own process.

Route needs the prompt's token ids. Asking a prefill server (vLLM's ``/tokenize``) costs an HTTP
round trip on a server that is busy computing prefills, inside every turn's time to first token.
The model's own Hugging Face tokenizer renders and
tokenizes the same prompt in milliseconds, as vLLM does for its HF renderer: the chat template
with the generation prompt, then the tokenizer without added special tokens (chat); the tokenizer
with its special tokens (completions).

What this does not render certainly as vLLM would (content parts, tool calls whose arguments vLLM
re-parses, tool definitions vLLM dumps with its defaults, roles it may rewrite) is left to
``/tokenize``: ``tokens`` answers None and the caller asks the server. Route's answer only advises:
a prompt tokenized differently costs a worse choice, never a wrong answer, because the prefill's own
Lookup matches the prompt the engine computes.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import structlog

from kvloop.clients.proxy.piece_cache import PieceCache

log = structlog.get_logger("kvloop.proxy")

_CHAT_KEYS = ("add_generation_prompt", "continue_final_message", "chat_template")


class PromptTokenizer:
    """One model's tokenizer (thread-safe to call: Hugging Face fast tokenizers are)."""

    def __init__(self, source: str) -> None:
        # transformers (and jinja2, its template engine) come with vLLM, not with kvloop's base install.
        import jinja2
        from transformers import AutoTokenizer

        self.source = source
        self._tokenizer: Any = AutoTokenizer.from_pretrained(source)
        self._refusals: tuple[type[Exception], ...] = (ValueError, TypeError, KeyError, jinja2.TemplateError)
        try:
            samples = [self._tokenizer.apply_chat_template(c, tokenize=False) for c in _SAMPLE_CHATS]
        except self._refusals:
            samples = []
        # The history a conversation resends every turn is tokenized once (None: not exact for it).
        self.pieces = PieceCache.for_tokenizer(self._tokenizer, samples) if samples else None

    def tokens(self, body: dict, chat: bool) -> list[int] | None:
        """The prompt's token ids as the server would compute them, or None when this request's
        rendering is not certainly vLLM's or the template refuses it (the caller then asks the server,
        which gives the client the template's error properly)."""
        try:
            return self._render(body, chat)
        except self._refusals as exc:
            log.debug("prompt not tokenized here", error=str(exc))
            return None

    def _render(self, body: dict, chat: bool) -> list[int] | None:
        if not chat:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return list(self._tokenizer.encode(prompt, add_special_tokens=True))
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(_plain(m) for m in messages):
            return None
        if body.get("tools") or body.get("documents"):
            return None  # vLLM hands the template its own dump of them (defaults filled in)
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs.update({k: body[k] for k in _CHAT_KEYS if body.get(k) is not None})
        kwargs.setdefault("add_generation_prompt", True)
        # As apply_chat_template(tokenize=True) does: the rendered text, no special tokens added.
        text = self._tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        if self.pieces is not None:
            return self.pieces.encode(text)
        return list(self._tokenizer.encode(text, add_special_tokens=False))


# Texts the piece cache must encode exactly as the whole before it is used: whitespace at the edges
# of messages, runs of spaces, tabs, newlines and accents, around the template's added tokens.
_SAMPLE_CHATS = [
    [
        {"role": "system", "content": "  You are terse.\n\nKeep it short. "},
        {"role": "user", "content": "héllo wörld  two  spaces\t and a tab\n"},
        {"role": "assistant", "content": " ok.  Done\n\n"},
        {"role": "user", "content": "12 345 6789!? (x) [y] {z} -- end"},
    ],
    [{"role": "user", "content": "\n leading newline, trailing spaces   "}],
]


def _plain(message: object) -> bool:
    """A message vLLM passes to the template as it is: a system, user or assistant role and a string
    content, no tool calls (vLLM re-parses their arguments; a developer role it may turn into system)."""
    return (
        isinstance(message, dict)
        and message.get("role") in ("system", "user", "assistant")
        and isinstance(message.get("content"), str)
        and not message.get("tool_calls")
    )


class PromptTokenizers:
    """Tokenizers by served model name, loaded in the background from ``source``: a path or Hugging
    Face id for every model, or ``auto`` (the model directory the servers report in ``/v1/models``
    as the model's ``root``, when it exists on this host), or ``remote`` (none: always
    ``/tokenize``). Loading takes seconds (importing transformers), so no request waits for it: until
    a model's tokenizer is loaded, and for good when it cannot be (said once in the log), its
    prompts are tokenized by the servers."""

    def __init__(self, source: str = "auto") -> None:
        self.source = source
        self._loaded: dict[str, PromptTokenizer | None] = {}  # None: cannot be loaded
        self._loading: set[str] = set()
        self._lock = threading.Lock()

    def get(self, model: str, root: str | None) -> PromptTokenizer | None:
        """The model's tokenizer when it is loaded; else None, and its loading starts (once)."""
        tokenizer = self._loaded.get(model)
        if tokenizer is not None or model in self._loaded:
            return tokenizer
        with self._lock:
            if model in self._loading or model in self._loaded:
                return None
            self._loading.add(model)
        threading.Thread(
            target=self._load, args=(model, root), name=f"tokenizer-{model}", daemon=True
        ).start()
        return None

    def status(self) -> dict[str, str]:
        """Per model: loaded (with its source), loading, or server (tokenized by the servers)."""
        with self._lock:
            out = {m: "loading" for m in self._loading}
            out.update({m: f"loaded from {t.source}" if t else "server" for m, t in self._loaded.items()})
        return out

    # One load at a time: transformers imports its classes lazily, and a second thread importing
    # AutoTokenizer while the first is still importing it gets an ImportError (seen with a base model
    # and its LoRA adapters, all served, loading at once).
    _load_lock = threading.Lock()

    def _load(self, model: str, root: str | None) -> None:
        source = self._source_for(root)
        tokenizer = None
        if source is not None:
            try:
                with self._load_lock:
                    tokenizer = PromptTokenizer(source)
                log.info("prompt tokenizer loaded", model=model, source=source)
            except (OSError, ValueError, ImportError) as exc:
                log.warning(
                    "prompt tokenizer not loaded: tokenizing on the servers", model=model, error=str(exc)
                )
        with self._lock:
            self._loaded[model] = tokenizer
            self._loading.discard(model)

    def _source_for(self, root: str | None) -> str | None:
        if self.source == "remote":
            return None
        if self.source != "auto":
            return self.source
        return root if root and Path(root).is_dir() else None
