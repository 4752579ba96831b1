"""The tiny models' word-level tokenizer: any answer a random-weight model generates tokenizes back to
the ids it generated once the chat template renders it into the next prompt (as a real model's answer
mostly does), so a decode's retained KV of that answer matches the next turn. Byte-level BPE does not:
the multi-turn bench's reason to use the word-level one."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from kvloop.clients.fleet.model import CHAT_TEMPLATE, _save_tokenizer
from kvloop.clients.proxy.prompt_tokens import PromptTokenizer

SPECIAL_IDS = (0, 1)  # <s>, </s>


def _tokenizer(tmp_path_factory, kind: str):
    out = tmp_path_factory.mktemp(f"tokenizer-{kind}")
    _save_tokenizer(out, vocab_size=1024, seed=3, chat_template=CHAT_TEMPLATE, kind=kind)
    return out, AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    return _tokenizer(tmp_path_factory, "words")


def _render(tokenizer, messages: list[dict]) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def _words(tokenizer, rnd: random.Random, n: int) -> str:
    return tokenizer.decode([rnd.randrange(2, len(tokenizer)) for _ in range(n)])


def _answer_round_trips(tokenizer, rnd: random.Random) -> bool:
    """A random answer (as a random-weight model emits) rendered into the next turn's prompt: are the
    prompt's ids the previous prompt's, then the answer's own?"""
    messages = [
        {"role": "system", "content": "You are an agent. kv cache block"},
        {"role": "user", "content": "Task: read file"},
    ]
    prompt = _render(tokenizer, messages)
    answer = [rnd.choice([i for i in range(2, len(tokenizer)) if i not in SPECIAL_IDS]) for _ in range(40)]
    text = tokenizer.decode(answer, skip_special_tokens=True)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Tool output: ok"}]
    return _render(tokenizer, messages)[: len(prompt) + len(answer)] == prompt + answer


def test_any_answer_tokenizes_back_to_the_ids_generated(words):
    _, tokenizer = words
    assert len(tokenizer) == 1024  # every id the model can emit decodes to a word
    rnd = random.Random(5)
    assert all(_answer_round_trips(tokenizer, rnd) for _ in range(50))


def test_byte_level_bpe_answers_do_not(tmp_path_factory):
    _, tokenizer = _tokenizer(tmp_path_factory, "bpe")
    rnd = random.Random(5)
    assert sum(_answer_round_trips(tokenizer, rnd) for _ in range(50)) < 5


def test_the_proxy_tokenizes_word_level_prompts_as_the_engine_does(words):
    out, tokenizer = words
    prompts = PromptTokenizer(str(out))
    rnd = random.Random(9)
    messages = [{"role": "system", "content": "You are an agent."}]
    for _ in range(4):
        messages.append({"role": "user", "content": "Tool output: " + _words(tokenizer, rnd, 30)})
        assert prompts.tokens({"model": "m", "messages": messages}, chat=True) == _render(tokenizer, messages)
        messages.append({"role": "assistant", "content": _words(tokenizer, rnd, 10)})


def test_an_unknown_tokenizer_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        _save_tokenizer(tmp_path, vocab_size=64, seed=0, kind="sentencepiece")
