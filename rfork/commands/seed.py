"""Not implemented yet (placeholder until its issue lands)."""

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    """Refuse clearly."""
    raise NotImplementedError(f"'{args.command}' is not implemented yet")
