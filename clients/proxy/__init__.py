"""`kvloop proxy`: OpenAI-compatible front over vLLM prefill/decode servers."""
