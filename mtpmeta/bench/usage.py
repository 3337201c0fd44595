"""Argument handling shared by the ``mtpmeta`` commands: one-line usage errors with
exit status 2, help that shows every default, and install advice that fits how the
package was installed.

Every check here runs before a command does any work, so a bad option costs nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import torch

__all__ = ["HelpFormatter", "ToolParser", "parse", "usage_error", "positive_int", "device_problem",
           "output_problem", "install_hint", "missing_module"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and epilog's line breaks and appends ``(default: X)``
    to every option whose default is a value (not None, not an off switch) and whose
    help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is None
                or action.default is False or action.default is argparse.SUPPRESS
                or "default" in text):
            return text
        return f"{text} (default: %(default)s)"


class ToolParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, exit status 2."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def parse(parser: argparse.ArgumentParser, argv: Optional[List[str]]
          ) -> Tuple[Optional[argparse.Namespace], int]:
    """``(args, 0)``, or ``(None, status)`` once ``--help`` (0) or a malformed option
    (2, its one line already printed) ended the parse: a command's ``main`` returns
    that status instead of raising SystemExit."""
    try:
        return parser.parse_args(argv), 0
    except SystemExit as exit_:
        return None, exit_.code if isinstance(exit_.code, int) else 2


def usage_error(prog: str, message: str) -> int:
    """Print ``prog: message`` to stderr as one line; return exit status 2."""
    print(f"{prog}: {message}", file=sys.stderr)
    return 2


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def device_problem(text: str) -> Optional[str]:
    """Why ``--device text`` cannot run here (not a torch device, not cpu/cuda, no
    CUDA, no such GPU), or None."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        return f"--device {text!r} is not a device; use cpu or cuda (cuda:N for GPU N)"
    if device.type not in ("cpu", "cuda"):
        return f"--device {text}: only cpu and cuda are supported"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {text}, but CUDA is not available (torch {torch.__version__})"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return (f"--device {text}, but this machine has "
                    f"{torch.cuda.device_count()} CUDA device(s)")
    return None


def output_problem(flag: str, path: str) -> Optional[str]:
    """Why ``path`` (for ``flag``) cannot be written once the run is over, or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{flag} {path} is a directory; give a file name"
    if not os.path.isdir(folder):
        return f"{flag} {path}: the directory {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"{flag} {path}: the directory {folder} is not writable"
    return None


def install_hint(extra: str) -> str:
    """The pip command that adds the optional dependencies ``extra``: an editable
    install of the source checkout this package runs from, else the published
    package's extra."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "mtpmeta" / "__init__.py").is_file():
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install 'mtpmeta[{extra}]'"


def missing_module(module: str, extra: str, flag: str) -> Optional[str]:
    """Why ``flag`` cannot run (``module`` is not importable), with the fitting install
    advice, or None."""
    if importlib.util.find_spec(module) is not None:
        return None
    return f"{flag} needs {module}, which is not installed: {install_hint(extra)}"
