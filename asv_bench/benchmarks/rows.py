"""Row lifecycle: the compaction moves, swaps and resets of STEPS standard steps."""

from mtpmeta.bench.workload import run_rows

from .common import StepFixture


class TimeRows(StepFixture):
    params = [StepFixture.params[0], StepFixture.params[1], [3]]

    def time_row_compaction(self, impl, active, depths):
        for inputs in self.steps:
            run_rows(self.meta, inputs)
