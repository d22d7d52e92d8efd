"""The ``flyspec`` command: one module per subcommand, the shared option groups in
:mod:`flyspec.cli.options`.

Commands depend on the applications (``bench``, ``evaluation``, ``server``) and the library,
never the other way round. User mistakes and environment problems end with one
``flyspec: error: ...`` line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flyspec.cli import bench, calibrate, doctor, evaluate, generate, manage, serve
from flyspec.cli.options import EXIT_USAGE, Parser
from flyspec.errors import FlyspecError
from flyspec.support.cpu_math import configure_cpu_math

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="flyspec",
        description="Training-free loosely speculative decoding (FLy) for Hugging Face LMs.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    generate.add_parser(commands)
    manage.add_parsers(commands)
    serve.add_parser(commands)
    evaluate.add_parser(commands)
    calibrate.add_parser(commands)
    bench.add_parser(commands)
    bench.add_compare_parser(commands)
    doctor.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    configure_cpu_math()
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except FlyspecError as error:
        print(f"flyspec: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nflyspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
