"""Whole standard steps (rows, carry, draft loop, commit pass): the headline number,
per step. ``TimeStepCuda`` needs CUDA: without it, it is skipped at discovery (asv
lists nothing for it), and its setup raises ``NotImplementedError`` (asv's skip) should
CUDA vanish between discovery and the run."""

import torch
from asv_runner.benchmarks.mark import skip_benchmark_if

from mtpmeta.bench.workload import run_step

from .common import StepFixture

NO_CUDA = "TimeStepCuda needs a CUDA device (torch.cuda.is_available() is False)"


class TimeStep(StepFixture):
    def time_standard_step(self, impl, active, depths):
        run_step(self.meta, self.view, self.next_inputs(), self.config)


class TimeStepCuda(StepFixture):
    """The standard step with buffers and view on CUDA, synchronized per step."""

    device = "cuda"

    def setup(self, impl, active, depths):
        if not torch.cuda.is_available():
            raise NotImplementedError(NO_CUDA)
        super().setup(impl, active, depths)
        torch.cuda.synchronize()

    @skip_benchmark_if(not torch.cuda.is_available())
    def time_standard_step_cuda(self, impl, active, depths):
        run_step(self.meta, self.view, self.next_inputs(), self.config)
        torch.cuda.synchronize()
