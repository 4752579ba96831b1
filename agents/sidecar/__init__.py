"""kvloop agents.sidecar."""
