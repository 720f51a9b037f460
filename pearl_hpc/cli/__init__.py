"""``pearl-hpc``, the command line (:mod:`.main`; one module per subcommand)."""

from pearl_hpc.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
