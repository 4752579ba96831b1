"""`kvloop-agent`: the sidecar beside one vLLM instance, streaming its block events to kvloopd."""
