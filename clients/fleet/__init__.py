"""The fleet launcher: kvloopd, vLLM engines, sidecars and the proxy on one machine (`stack`), the tiny
random-weight test models they serve (`model`), and a throwaway local redis-server (`redis_local`), for
the demo, benchmarks and tests."""
