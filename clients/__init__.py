"""kvloop clients: the directory client library, the `kvloop` CLI, the proxy, benchmarks, the fleet
launcher and the demo (each a package of its own; importing this one loads none of them)."""
