"""Chunk-boundary carry and take at the seam."""

from mtpmeta.bench.workload import run_carry

from .common import StepFixture


class TimeCarry(StepFixture):
    params = [StepFixture.params[0], [64], [3]]

    def time_carry_and_take(self, impl, active, depths):
        for inputs in self.steps:
            run_carry(self.meta, inputs)
