"""``python -m mtpmeta bench|simulate`` (also the ``mtpmeta`` console script)."""

from __future__ import annotations

import sys
from typing import List, Optional

USAGE = """usage: mtpmeta COMMAND [options]
  bench      per-step host cost against the reference   (mtpmeta bench --help)
  simulate   end-to-end engine over a paged KV cache     (mtpmeta simulate --help)"""


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "bench":
        from .bench import main as bench_main

        return bench_main(argv[1:])
    if argv[0] == "simulate":
        from .simulate.cli import main as simulate_main

        return simulate_main(argv[1:])
    print(f"mtpmeta: unknown command {argv[0]!r}; the commands are 'bench' and "
          "'simulate'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
