"""The draft loop: begin_decode, depths x (setup_decode_step + advance), end_forward, one
loop per step."""

from mtpmeta.bench.workload import run_draft

from .common import StepFixture


class TimeDraftLoop(StepFixture):
    def time_draft_loop(self, impl, active, depths):
        run_draft(self.meta, self.view, self.next_inputs(), self.config)
