"""kvloop common."""
