"""Seeded setup shared by the asv benchmarks: the standard step at a given batch size,
the library (direct and mirror paths) beside the pure-torch reference."""

import torch

from mtpmeta.bench.variants import build
from mtpmeta.bench.workload import StepConfig, make_steps

ACTIVE = [8, 64, 256]
DEPTHS = [1, 3]
IMPLS = ["reference", "direct", "mirror"]
STEPS = 4

torch.set_num_threads(1)


def config(active, depths=3):
    return StepConfig(max_requests=max(256, active + 1), active=active, depths=depths)


class StepFixture:
    """``setup`` builds one implementation, draws the seeded steps and warms the JIT
    and the per-shape caches by running every step once."""

    params = [IMPLS, ACTIVE, DEPTHS]
    param_names = ["impl", "active", "depths"]

    def setup(self, impl, active, depths):
        self.config = config(active, depths)
        self.steps = make_steps(self.config, STEPS, seed=0)
        self.meta, self.view = build(impl, self.config, torch.device("cpu"))
        from mtpmeta.bench.workload import run_step

        for inputs in self.steps:
            run_step(self.meta, self.view, inputs, self.config)
