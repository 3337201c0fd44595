"""``python -m mtpmeta bench`` (also the ``mtpmeta`` console script)."""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mtpmeta bench [--quick] [--json PATH] [...]   (mtpmeta bench --help)")
        return 0 if argv else 2
    if argv[0] != "bench":
        print(f"mtpmeta: unknown command {argv[0]!r}; the only command is 'bench'",
              file=sys.stderr)
        return 2
    from .bench import main as bench_main

    return bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
