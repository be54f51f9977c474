"""`stepahead serve [MODEL]`: registers the server's subcommand with the `stepahead` command."""

from __future__ import annotations

import argparse

from stepahead.entrypoints.openai.server_args import DESCRIPTION, add_server_args


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="start the OpenAI-compatible HTTP server", description=DESCRIPTION)
    add_server_args(parser)
    parser.set_defaults(func=_run)
    return parser


def _run(ns: argparse.Namespace) -> int:
    # Imported on use: FastAPI and uvicorn load only for the subcommand that needs them.
    from stepahead.entrypoints.openai.api_server import run

    return run(ns)
