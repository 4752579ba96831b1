"""A reasoning model's next turn: the chat template drops the earlier turn's thinking (as Qwen3's does).

The decode retained the prompt plus everything it generated, thinking first. The next prompt keeps
the previous prompt, then the answer without the thinking: it departs from the retained run where
the thinking began, well before the run's end. A positional pull (vLLM's built-in reverse mode)
would hand over the thinking's KV for the answer's positions; kvloop's pull must stop exactly at
the first block that differs, and every pulled block must equal a recompute.
"""

from __future__ import annotations

import random

import pytest
from conftest import BS
from test_reverse_pull import first_turn, prefill_and_check, rand_tokens

pytestmark = pytest.mark.engines


@pytest.fixture(autouse=True)
def default_stack(engines):
    engines.ensure_default_stack()


@pytest.mark.parametrize("prompt_len", [1200, 1216])  # departure inside a block / on a block boundary
def test_stripped_thinking_pulls_up_to_the_first_differing_block(engines, prompt_len):
    rnd = random.Random(prompt_len)
    prompt = rand_tokens(rnd, prompt_len)
    d = first_turn(engines, prompt, 96, prefill_salt=f"cold-reasoning-{prompt_len}")
    thinking, answer = d["token_ids"][:64], d["token_ids"][64:]
    next_prompt = prompt + answer + rand_tokens(rnd, 150)
    # the first token where the next prompt departs from what the decode holds
    held = prompt + thinking + answer
    departs = next(i for i, (a, b) in enumerate(zip(held, next_prompt, strict=False)) if a != b)
    assert prompt_len <= departs < prompt_len + 3  # the answer's first tokens may equal the thinking's
    pf = prefill_and_check(engines, next_prompt)  # KV of every full block equals a recompute
    s = pf.span
    assert s["kvloop.path"] == "transfer", s
    # hash-matched blocks only: every block before the departure, none from it on
    assert s["kvloop.matched_tokens"] == departs // BS * BS
    assert pf.out["num_cached_tokens"] == departs // BS * BS
