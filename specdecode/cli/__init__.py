"""Command-line interface: thin wrappers that parse, call the library, and print."""

from specdecode.cli.main import main

__all__ = ["main"]
