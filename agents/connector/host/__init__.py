"""The host retention tier: a pool of host memory laid out like the KV cache (``pool``), the copies
of retained runs written into it and announced from it (``tier``), and the order in which a full pool
gives copies up (``eviction``). ``eviction`` imports neither torch nor vLLM, so the replay uses the
connector's own policies; the names the scheduler side, the sidecar and the replay share are in
``kvloop.common.host_names``."""
