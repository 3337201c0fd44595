"""The varlen commit pass (decode spans + one prefill chunk with inherited blocks), one
per step."""

from mtpmeta.bench.workload import run_commit

from .common import StepFixture


class TimeCommitPass(StepFixture):
    params = [StepFixture.params[0], StepFixture.params[1], [3]]

    def time_commit_pass(self, impl, active, depths):
        run_commit(self.meta, self.view, self.next_inputs())
