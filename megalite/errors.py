"""The exceptions megalite raises for problems a user can fix, and the one reporter every entry point uses.

Entry points (`pretrain.py`, `tools/*.py`) catch `MegaliteError` and print its message on one line
with an exit code, instead of a traceback wall: the message itself must say what is wrong and how to
fix it. `entry_point` wraps a `main(argv) -> int` so that this holds for every tool the same way,
including argparse's own errors and operating-system errors (disk full, permission denied) that no
megalite check anticipated.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, NoReturn


INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C


class MegaliteError(Exception):
    """Base class: a user-fixable problem. `exit_code` is what the entry point exits with."""

    exit_code: int = 1


class ConfigError(MegaliteError):
    """A bad config value, key, combination or parallel layout (also a tool's bad argument)."""

    exit_code = 2


class DataError(MegaliteError):
    """Missing, empty, truncated or mismatched data / tokenizer files."""

    exit_code = 3


class CheckpointError(MegaliteError):
    """A checkpoint that is missing, partial, from another model, or cannot be written."""

    exit_code = 4


class LaunchError(MegaliteError):
    """A wrong launcher environment (e.g. RANK without WORLD_SIZE, RANK >= WORLD_SIZE, a missing peer)."""

    exit_code = 5


class StorageError(MegaliteError):
    """The operating system refused a read or write no check foresaw (disk full, permission, I/O error)."""

    exit_code = 1


def one_line(text: str) -> str:
    """`text` with its line breaks folded, so a wrapped library message still prints as one line."""
    return " ".join(str(text).split())


def from_os_error(e: OSError) -> StorageError:
    """A StorageError naming the path and the system's reason, e.g. 'No space left on device'."""
    where = f"{e.filename}: " if e.filename else ""
    return StorageError(f"{where}{e.strerror or e} (check the path, its permissions and the free disk space)")


def report(error: MegaliteError, prefix: str = "error") -> int:
    """Print a user-fixable error as one line on stderr and return its exit code (for entry points)."""
    print(f"{prefix}: {one_line(str(error))}", file=sys.stderr)
    return error.exit_code


class _ArgumentError(ConfigError):
    """argparse's complaint about a tool's command line (exit 2, like argparse itself)."""


def _raise_config_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    raise _ArgumentError(f"{parser.prog}: {message} (see --help)")


def one_line_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser` raise ConfigError instead of printing usage + error on two lines and exiting."""
    parser.error = functools.partial(_raise_config_error, parser)  # type: ignore[method-assign]
    return parser


def entry_point(main: Callable[[list[str] | None], int], prefix: str = "error") -> Callable[..., int]:
    """Wrap a tool's `main(argv) -> int`: a MegaliteError, an OSError or undecodable text becomes one line
    and its exit code."""

    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except MegaliteError as e:
            return report(e, prefix)
        except OSError as e:
            return report(from_os_error(e), prefix)
        except UnicodeDecodeError as e:  # a text input that is not UTF-8, read by code that did not expect it
            return report(DataError(f"an input file is not UTF-8 text ({e.reason} at byte {e.start}): convert "
                                    "it, e.g. `iconv -t utf-8`"), prefix)
        except KeyboardInterrupt:  # Ctrl-C: the tool's own cleanup (temporary outputs) has already run
            print(f"{prefix}: interrupted (Ctrl-C): stopped before finishing; no partial output is left and "
                  "existing outputs are unchanged", file=sys.stderr)
            return INTERRUPTED_EXIT

    return wrapped
