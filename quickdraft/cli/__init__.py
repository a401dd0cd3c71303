"""The command line: parse (parser.py), call the library, format (commands.py)."""

from __future__ import annotations

import logging
import sys

from quickdraft.cli.commands import COMMANDS, DEMO_PROMPT  # noqa: F401 (DEMO_PROMPT: the benchmarks' prompt)
from quickdraft.cli.parser import build_parser
from quickdraft.errors import QuickdraftError
from quickdraft.tools.flags import say


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s: %(message)s", stream=sys.stderr)
    try:
        if getattr(args, "threads", None):
            import torch

            torch.set_num_threads(args.threads)
        return COMMANDS[args.command](args)
    except QuickdraftError as e:
        if args.debug:
            raise
        print(f"error: {say(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug of ours: one line, the traceback behind --debug
        if args.debug:
            raise
        print(f"error: unexpected {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 2
