"""``mtpmeta simulate``: a small end-to-end speculative-decoding engine, and an
integration example for engine authors.

It drives the public API of ``MTPMetadata`` (and ``ContextGPUView``) the way upstream's
dynamic inference context does, over a real paged KV cache, and checks every forward
against a dense recomputation. Read it in this order:

* ``engine``     one step: rows, main model, commit pass, draft loop, retire;
* ``scheduler``  arrivals, prefix matching, chunk planning, pause/resume, compaction;
* ``rows``       the row table: library annotations and engine state moved together;
* ``blocks``     ref-counted block pool and prefix cache;
* ``paged``      the paged cache: KV append through the token maps, varlen paged
  attention through the MHA metadata;
* ``model``      the tiny deterministic main model and MTP layer;
* ``checks``     what is checked after each forward, and the dense oracle;
* ``runner``, ``cli``   ``run_path`` and the command line.
"""

from mtpmeta.simulate.checks import Checker, DenseOracle, Expectation
from mtpmeta.simulate.config import SimConfig
from mtpmeta.simulate.engine import Engine
from mtpmeta.simulate.mismatch import Mismatch
from mtpmeta.simulate.runner import FEATURES, PATHS, run_path

__all__ = ["SimConfig", "Engine", "Mismatch", "Checker", "DenseOracle", "Expectation",
           "run_path", "FEATURES", "PATHS", "main"]


def main(argv=None) -> int:
    """``mtpmeta simulate [...]``; see ``mtpmeta.simulate.cli``."""
    from mtpmeta.simulate.cli import main as cli_main

    return cli_main(argv)
