"""``OptionError``: a bad option value named by its option key (``steps must be >= 1, got 0``),
not by how a user spelled it; the CLI names the flag (``cli_flag``), a tasks file its key."""

from __future__ import annotations

# Unbound fields whose flag (and tasks-file key) is not the field's own name.
CLI_NAMES = {"chunk_bytes": "swap_chunk_mb"}


class OptionError(ValueError):
    """``field`` (an option key or a dataclass field name) and ``problem`` (``must be >= 1, got 0``,
    ``'x': choose one of a, b``); ``str()`` is ``"<field> <problem>"``."""

    def __init__(self, field: str, problem: str) -> None:
        self.field, self.problem = field, problem
        super().__init__(f"{field} {problem}")

    def named(self, name: str) -> str:
        """The message with ``name`` in place of the field."""
        return f"{name} {self.problem}"


def cli_key(field: str) -> str:
    """The tasks-file key (and argparse ``dest``) of ``field``."""
    return CLI_NAMES.get(field, field)


def cli_flag(field: str) -> str:
    """The command-line flag of ``field``: ``--`` + its key with dashes."""
    return "--" + cli_key(field).replace("_", "-")
