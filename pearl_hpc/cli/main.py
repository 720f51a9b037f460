"""``pearl-hpc``: the command line, one module per subcommand.

Errors a user can fix (bad files, bad values, impossible SPECs) print one line and exit
with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from pearl_hpc.cli import calibrate, cluster, evaluate, export, plan, run, simulate, tools
from pearl_hpc.cli.common import EXIT_USAGE, Parser
from pearl_hpc.errors import PearlError
from pearl_hpc.rundir import private_files

SUBCOMMANDS = (plan, simulate, calibrate, run, cluster, evaluate, export, tools)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pearl-hpc",
        description="PEARL (adaptive prefill-decode execution with elasticity for agentic RL) "
        "on Slurm clusters: plan, simulate, calibrate, run, benchmark.",
    )
    parser.add_argument("--version", action="version", version=f"pearl-hpc {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in SUBCOMMANDS:
        module.add_parsers(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pearl_hpc")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    private_files()  # a run's files, exports and reports: the user's alone
    try:
        return int(args.func(args))
    except PearlError as exc:
        print(f"pearl-hpc: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pearl-hpc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `pearl-hpc plan --json | head`: the reader has gone
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes
        return 0


if __name__ == "__main__":
    sys.exit(main())
