"""The ``hf-paged`` command line (``commands.py``), its flags (``options.py``), its input checks (``checks.py``),
the engine it builds (``engine.py``), replicas (``replicas.py``), the process's start-up and exit
(``lifetime.py``). ``python -m hf_paged.cli`` runs it."""

from hf_paged.cli.commands import build_parser, entry, main

__all__ = ["build_parser", "entry", "main"]
