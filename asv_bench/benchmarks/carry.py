"""Chunk-boundary carry and take at the seam, one of each per step."""

from mtpmeta.bench.workload import run_carry

from .common import StepFixture


class TimeCarry(StepFixture):
    params = [StepFixture.params[0], [64], [3]]

    def time_carry_and_take(self, impl, active, depths):
        run_carry(self.meta, self.next_inputs())
