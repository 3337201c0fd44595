"""``python -m mtpmeta bench|simulate`` (also the ``mtpmeta`` console script)."""

from __future__ import annotations

import sys
from typing import List, Optional

from mtpmeta._version import __version__

USAGE = f"""usage: mtpmeta COMMAND [options]   (mtpmeta --version: {__version__})

Host-side bookkeeping for MTP speculative decoding with a draft KV cache; its two tools:
  bench      per-step host cost against the reference   (mtpmeta bench --help)
  simulate   end-to-end engine over a paged KV cache     (mtpmeta simulate --help)"""


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"mtpmeta {__version__}")
        return 0
    if argv[0] == "bench":
        from mtpmeta.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[0] == "simulate":
        from mtpmeta.simulate.cli import main as simulate_main

        return simulate_main(argv[1:])
    print(f"mtpmeta: unknown command {argv[0]!r}; the commands are 'bench' and "
          "'simulate' (mtpmeta --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
