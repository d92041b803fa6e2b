"""Command-line plumbing shared by the data tools: one-line errors and exit code 2."""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager


class ToolParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`tool: error: ...`), like every project tool."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


@contextmanager
def exit_on_user_error(program: str):
    """Turn the library's user-facing errors (bad file, bad flag value) into one line and exit 2."""
    try:
        yield
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as error:
        print(f"{os.path.basename(program)}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
