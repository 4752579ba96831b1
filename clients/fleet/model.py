"""Tiny random-weight models built locally (no model can be downloaded here): a Llama and a
Gemma-3-like hybrid (sliding-window + full attention).

A byte-level BPE tokenizer trained on a made-up corpus, with a chat template so the OpenAI chat
endpoint works, and `transformers.LlamaConfig` weights saved in bf16. Greedy output is
deterministic; scale `hidden_size` / `layers` for a costlier prefill.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORDS = [
    "kv",
    "cache",
    "block",
    "transfer",
    "prefill",
    "decode",
    "engine",
    "token",
    "hash",
    "lease",
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "at",
    "model",
    "layer",
    "attention",
    "head",
    "vector",
    "matrix",
    "loop",
    "daemon",
    "worker",
    "peer",
    "tool",
    "call",
    "result",
    "search",
    "file",
    "read",
    "write",
    "error",
    "ok",
    "user",
    "agent",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)

# As Qwen3's template does, an earlier assistant turn is rendered without its thinking: only what
# follows the last "</think>". The next prompt then departs from what the decode generated (and
# retained) where the thinking began, well before the end of the retained run.
REASONING_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' and '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


# The words the bench's and demo's chat templates and messages put in a prompt, beside WORDS.
TEMPLATE_WORDS = [
    "system",
    "user",
    "assistant",
    "You",
    "are",
    "an",
    "Task",
    "Tool",
    "output",
    "Answer",
    "think",
]
# The tokenizers a tiny model can have (see _save_tokenizer).
TOKENIZERS = ("bpe", "words")


def _save_tokenizer(
    out: Path, vocab_size: int, seed: int, chat_template: str = CHAT_TEMPLATE, kind: str = "bpe"
) -> None:
    """A tokenizer for the tiny model, saved to ``out``.

    ``bpe``: byte-level BPE trained on a made-up corpus of WORDS. A random-weight model emits token
    ids in no tokenizer's canonical order, so the text of its answer tokenizes back to other ids:
    the next turn's prompt departs from the KV of the answer the decode computed at its first
    answer token. A real model's answers mostly tokenize back to what it generated.

    ``words``: one token per whitespace- or punctuation-separated word (WORDS, the templates' words,
    then made-up words up to ``vocab_size``), so any answer tokenizes back to the ids generated, as a
    real model's answer mostly does: the next turn can reuse the answer's KV (the multi-turn bench).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {kind!r}")
    specials = ["<s>", "</s>"]
    if kind == "words":
        known = list(dict.fromkeys(specials + WORDS + TEMPLATE_WORDS + list(":.,<>/")))
        made_up = [f"w{i}" for i in range(max(0, vocab_size - len(known)))]
        vocab = {word: i for i, word in enumerate(known + made_up)}
        # A word outside the vocabulary (never in the bench's own messages) reads as </s>, which the
        # model already knows, rather than as an id of its own past the model's vocabulary.
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        # decoded words joined by single spaces: the pre-tokenizer splits them back the same way
        tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    else:
        rnd = random.Random(seed)
        corpus = [" ".join(rnd.choice(WORDS) for _ in range(40)) for _ in range(2000)]
        tokenizer = Tokenizer(models.BPE(unk_token=None))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,  # it writes to stdout, which a --json command keeps for its JSON
        )
        tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = chat_template
    fast.save_pretrained(out)


def _build(out: Path, spec: dict[str, Any], make_model: Callable[[], Any]) -> Path:
    """Reuse ``out`` when it was built from ``spec``; else tokenizer + ``make_model()`` saved there."""
    import torch

    marker = out / "kvloop-tiny.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(
        out,
        spec["vocab_size"],
        spec["seed"],
        spec.get("chat_template", CHAT_TEMPLATE),
        spec.get("tokenizer", "bpe"),
    )
    torch.manual_seed(spec["seed"])
    # transformers wraps PreTrainedModel.to in a decorator its stubs type wrongly
    make_model().to(torch.bfloat16).save_pretrained(out)
    marker.write_text(json.dumps(spec))
    return out


def build_tiny_llama(
    out: Path,
    *,
    hidden_size: int = 384,
    layers: int = 4,
    heads: int = 6,
    intermediate_size: int = 1024,
    vocab_size: int = 1024,
    seed: int = 0,
    chat_template: str = CHAT_TEMPLATE,
    tokenizer: str = "bpe",
) -> Path:
    """Write a model directory vLLM can serve; returns it. Reuses an existing build.
    ``tokenizer``: "bpe" or "words" (see :func:`_save_tokenizer`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec: dict[str, object] = {
        "hidden_size": hidden_size,
        "layers": layers,
        "heads": heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "seed": seed,
    }
    if chat_template != CHAT_TEMPLATE:
        spec["chat_template"] = chat_template
    if tokenizer != "bpe":
        spec["tokenizer"] = tokenizer
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=32768,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    return _build(out, spec, lambda: LlamaForCausalLM(config))


def build_tiny_lora(model_dir: Path, out: Path, *, rank: int = 8, seed: int = 0) -> Path:
    """A random LoRA adapter (PEFT layout: q_proj and v_proj of every layer) for a tiny model
    built by :func:`build_tiny_llama`; returns its directory. Its B matrices are not zero, so a
    request through it computes other KV than the base model's."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for proj in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(hidden, rank, generator=generator) * 0.05
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(model_dir),
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "target_modules": ["q_proj", "v_proj"],
                "bias": "none",
                "fan_in_fan_out": False,
            }
        )
    )
    return out


# Sliding window of the tiny hybrid model, in tokens: 4 blocks of 32, so a conversation of a few
# hundred tokens already leaves most of its sliding-window KV outside the window.
HYBRID_SLIDING_WINDOW = 128


def build_tiny_hybrid(
    out: Path,
    *,
    hidden_size: int = 384,
    layers: int = 4,
    heads: int = 6,
    intermediate_size: int = 1024,
    vocab_size: int = 1024,
    sliding_window: int = HYBRID_SLIDING_WINDOW,
    seed: int = 0,
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """A tiny random-weight Gemma-3-like model: sliding-window and full-attention layers alternate
    (as many of each, so vLLM's hybrid KV-cache allocator gives two KV-cache groups of equal
    page size: one sliding-window, one full attention)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    spec: dict[str, object] = {
        "arch": "gemma3",
        "hidden_size": hidden_size,
        "layers": layers,
        "heads": heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "sliding_window": sliding_window,
        "seed": seed,
    }
    if chat_template != CHAT_TEMPLATE:
        spec["chat_template"] = chat_template
    head_dim = hidden_size // heads
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=sliding_window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        max_position_embeddings=32768,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=True,
    )
    return _build(out, spec, lambda: Gemma3ForCausalLM(config))


MODEL_BUILDERS = {"llama": build_tiny_llama, "hybrid": build_tiny_hybrid}


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_bytes_per_block(model_dir: Path, block_size: int, dtype_bytes: int = 2) -> int:
    """K and V of one block over all layers, from the model's config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * block_size * dtype_bytes


def kv_group_windows(model_dir: Path) -> list[int]:
    """Each KV-cache group's sliding window (0: full attention) as vLLM 0.32's hybrid allocator forms
    them from the model's config.json: with sliding-window and full-attention layers in equal numbers,
    the sliding-window group first (checked by tests/engines/test_hybrid.py)."""
    config = json.loads((model_dir / "config.json").read_text())
    window = config.get("sliding_window") or 0
    kinds = set(config.get("layer_types") or [])
    if window and kinds == {"sliding_attention", "full_attention"}:
        return [window, 0]
    if window and kinds <= {"sliding_attention"} and config.get("use_sliding_window", True):
        return [window]
    return [0]


def random_text(words: int, seed: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(words))
