"""The varlen commit pass (decode spans + one prefill chunk with inherited blocks)."""

from mtpmeta.bench.workload import run_commit

from .common import StepFixture


class TimeCommitPass(StepFixture):
    params = [StepFixture.params[0], StepFixture.params[1], [3]]

    def time_commit_pass(self, impl, active, depths):
        for inputs in self.steps:
            run_commit(self.meta, self.view, inputs)
