"""Seeded setup shared by the asv benchmarks: the standard step at a given batch size,
the library (direct and mirror paths) beside the pure-torch reference.

Units: every ``time_`` benchmark built on ``StepFixture`` runs ONE standard step (or one
step's share of it: its draft loop, its commit pass, ...) per call, the next of the
``STEPS`` seeded steps in turn, so asv reports time per step, the unit of
``mtpmeta bench``. asv itself repeats the call (``number`` per sample) and averages.
"""

import torch

from mtpmeta.bench.variants import build
from mtpmeta.bench.workload import StepConfig, make_steps, run_step

ACTIVE = [8, 64, 256]
DEPTHS = [1, 3]
IMPLS = ["reference", "direct", "mirror"]
STEPS = 4  # distinct seeded steps a benchmark cycles through, one per call

torch.set_num_threads(1)


def config(active, depths=3):
    return StepConfig(max_requests=max(256, active + 1), active=active, depths=depths)


class StepFixture:
    """``setup`` builds one implementation on ``device``, draws the seeded steps and
    warms the JIT and the per-shape caches by running every step once;
    ``next_inputs()`` hands out the steps in a cycle, one per timed call."""

    params = [IMPLS, ACTIVE, DEPTHS]
    param_names = ["impl", "active", "depths"]
    device = "cpu"

    def setup(self, impl, active, depths):
        self.config = config(active, depths)
        self.steps = make_steps(self.config, STEPS, seed=0)
        self.meta, self.view = build(impl, self.config, torch.device(self.device))
        for inputs in self.steps:
            run_step(self.meta, self.view, inputs, self.config)
        self._next = 0

    def next_inputs(self):
        """The next of the ``STEPS`` seeded steps' inputs, cycling."""
        inputs = self.steps[self._next]
        self._next = (self._next + 1) % len(self.steps)
        return inputs
