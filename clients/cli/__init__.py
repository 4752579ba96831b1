"""The `kvloop` command line."""
