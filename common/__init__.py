"""Pieces every kvloop process shares: logging, tracing, security settings."""
