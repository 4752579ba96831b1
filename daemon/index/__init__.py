"""kvloop daemon.index."""
