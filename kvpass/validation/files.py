"""Checks of command-line options and files (the CLI, calibration files)."""

from __future__ import annotations

from kvpass.validation.rules import refuse


def check_option(name: str, ok: bool, got: object, allowed: str) -> None:
    """A command-line option ``name`` (e.g. ``--max-new-tokens``) whose value ``got`` must be ``allowed``."""
    if not ok:
        raise refuse("cli.value", argument=name, name=name, got=got, allowed=allowed)


def check_readable_file(name: str, path: object) -> None:
    """A path (CLI option ``name``) that exists and is a file kvpass can open."""
    import os

    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise refuse("file.missing", argument=name, name=name, got=str(path))
