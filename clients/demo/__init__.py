"""`kvloop demo`: the whole loop on one machine with a tiny random-weight model."""
