"""kvloop agents."""
