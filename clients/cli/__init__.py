"""kvloop clients.cli."""
