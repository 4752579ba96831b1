"""The proxy's piece cache gives the ids of encoding the whole rendered prompt, turn after turn, and
stays off for a tokenizer it cannot be exact for."""

from __future__ import annotations

import random

import pytest

from kvloop.clients.fleet.model import REASONING_CHAT_TEMPLATE, WORDS, _save_tokenizer
from kvloop.clients.proxy.piece_cache import PieceCache
from kvloop.clients.proxy.prompt_tokens import PromptTokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    _save_tokenizer(out, vocab_size=512, seed=3, chat_template=REASONING_CHAT_TEMPLATE)
    return out


def text(rnd: random.Random, words: int) -> str:
    """Words with the whitespace, punctuation and accents that move BPE merges at piece edges."""
    seps = [" ", "  ", "\n", "\t", " \n ", ""]
    extras = ["é", "ü", "!?", "<s", "s>", "</", "123", " "]
    return "".join(rnd.choice(WORDS + extras) + rnd.choice(seps) for _ in range(words))


def test_a_growing_conversation_is_tokenized_as_the_whole_is(tokenizer_dir):
    prompts = PromptTokenizer(str(tokenizer_dir))
    assert prompts.pieces is not None  # the demo tokenizer's added tokens take no whitespace
    whole = prompts._tokenizer
    for seed in range(20):
        rnd = random.Random(seed)
        messages = [{"role": "system", "content": text(rnd, 60)}]
        for _ in range(4):
            messages.append({"role": "user", "content": text(rnd, 40)})
            body = {"model": "m", "messages": messages}
            expected = whole.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            assert prompts.tokens(body, chat=True) == list(expected), (seed, messages)
            think = f"<think>{text(rnd, 8)}</think> " if rnd.random() < 0.5 else ""
            messages.append({"role": "assistant", "content": think + text(rnd, 6)})
    # the history was encoded once: later turns found its pieces
    assert prompts.pieces.hits > prompts.pieces.misses


def test_the_cache_stays_within_its_bound(tokenizer_dir):
    prompts = PromptTokenizer(str(tokenizer_dir))
    cache = PieceCache.for_tokenizer(prompts._tokenizer, [], max_chars=500)
    assert cache is not None
    rnd = random.Random(7)
    for _ in range(50):
        rendered = "<s>user: " + text(rnd, 30) + "\n<s>assistant: "
        assert cache.encode(rendered) == list(prompts._tokenizer.encode(rendered, add_special_tokens=False))
        assert cache._chars <= 500


def test_no_cache_where_added_tokens_take_whitespace(tokenizer_dir):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<tool>", lstrip=True)]})
    assert PieceCache.for_tokenizer(tokenizer, ["<s>user: hi <tool> x"]) is None


def test_no_cache_where_pieces_are_not_encoded_alike():
    """Sentencepiece-style Metaspace that prepends its marker to the first piece only: a piece
    encoded alone is not encoded as it is inside the whole, and the sample check finds it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>"], show_progress=False)
    raw.train_from_iterator([" ".join(WORDS[i : i + 8]) for i in range(0, len(WORDS), 3)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", unk_token="<unk>")
    sample = "<s>user: " + " ".join(WORDS[:6]) + "<s>assistant: " + " ".join(WORDS[6:9])
    assert PieceCache.for_tokenizer(tokenizer, [sample]) is None
