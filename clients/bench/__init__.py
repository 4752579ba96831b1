"""kvloop clients.bench."""
