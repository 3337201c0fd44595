"""Whole standard steps (rows, carry, draft loop, commit pass): the headline number."""

import torch

from mtpmeta.bench.workload import run_step

from .common import STEPS, StepFixture


class TimeStep(StepFixture):
    def time_standard_step(self, impl, active, depths):
        for inputs in self.steps:
            run_step(self.meta, self.view, inputs, self.config)


class TimeStepCuda(StepFixture):
    def setup(self, impl, active, depths):
        if not torch.cuda.is_available():
            raise NotImplementedError("needs CUDA")
        super().setup(impl, active, depths)

    def time_standard_step_cuda(self, impl, active, depths):
        for inputs in self.steps:
            run_step(self.meta, self.view, inputs, self.config)
        torch.cuda.synchronize()
