"""The exceptions megalite raises for problems a user can fix.

Entry points (`pretrain.py`, `tools/*.py`) catch `MegaliteError` and print its message on one line
with an exit code, instead of a traceback wall: the message itself must say what is wrong and how to
fix it.
"""


class MegaliteError(Exception):
    """Base class: a user-fixable problem. `exit_code` is what the entry point exits with."""

    exit_code: int = 1


class ConfigError(MegaliteError):
    """A bad config value, key, combination or parallel layout."""

    exit_code = 2


class DataError(MegaliteError):
    """Missing, empty, truncated or mismatched data / tokenizer files."""

    exit_code = 3


class CheckpointError(MegaliteError):
    """A checkpoint that is missing, partial, from another model, or cannot be written."""

    exit_code = 4


class LaunchError(MegaliteError):
    """A wrong launcher environment (e.g. RANK without WORLD_SIZE)."""

    exit_code = 5


def report(error: MegaliteError, prefix: str = "error") -> int:
    """Print a user-fixable error as one line on stderr and return its exit code (for entry points)."""
    import sys

    print(f"{prefix}: {error}", file=sys.stderr)
    return error.exit_code
