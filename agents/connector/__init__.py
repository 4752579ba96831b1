"""kvloop agents.connector."""
