"""kvloop clients."""
