"""kvloop daemon."""
