"""``python -m flashtile <command>`` (or the ``flashtile`` console script).

``demo`` (flashtile.demo) checks flashtile against float64 attention and shows its
memory growing linearly with the sequence length beside naive attention's quadratic
growth. ``bench``, ``info`` and ``tune`` (speed and accuracy tables, versions and device
ceilings, the kernel tile study) live in ``flashtile.bench.commands``.

Each command is one ``add_<command>`` function that registers its parser and handler.
A mistake on the command line prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from flashtile import demo
from flashtile.bench import commands as bench_commands
from flashtile.engine.cli import add_convert_gguf, add_generate
from flashtile.engine.server import add_serve


class Parser(argparse.ArgumentParser):
    """argparse, but a mistake prints one line, "flashtile <command>: error: <what is
    wrong and what to do>" (no usage block), and exits with status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="flashtile", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log INFO from the 'flashtile' logger (kernel compiles)")
    commands = parser.add_subparsers(dest="command", metavar="command")
    for add in (demo.add_demo, bench_commands.add_bench, bench_commands.add_info,
                bench_commands.add_tune, add_generate, add_serve,
                add_convert_gguf):
        add(commands)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and argv[1:2] in (["serve"], ["throughput"], ["kv-waste"],
                                               ["hf"], ["host"]):
        # Benchmarks with parsers of their own (argparse hands no unparsed
        # options down to a sub-parser).
        module = argv[1].replace("-", "_")
        return importlib.import_module(f"flashtile.bench.{module}").main(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv  # recorded in the bench JSON as the command line
    if args.command is None:
        parser.print_help()
        return 2
    if args.verbose:
        logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
        logging.getLogger("flashtile").setLevel(logging.INFO)
    try:
        return args.handler(args)
    except bench_commands.UsageError as err:
        print(f"flashtile {args.command}: error: {err}", file=sys.stderr)
        return 2
