"""Row lifecycle: a standard step's compaction moves, swaps and resets."""

from mtpmeta.bench.workload import run_rows

from .common import StepFixture


class TimeRows(StepFixture):
    params = [StepFixture.params[0], StepFixture.params[1], [3]]

    def time_row_compaction(self, impl, active, depths):
        run_rows(self.meta, self.next_inputs())
