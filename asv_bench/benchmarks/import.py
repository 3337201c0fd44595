"""Cold start: a new interpreter importing mtpmeta and running the first step, and the
peak memory of allocating at capacity."""

import torch

from mtpmeta import MTPMetadata
from mtpmeta.bench.workload import StepConfig


class ColdStart:
    timeout = 180

    def timeraw_import_and_first_step(self):
        return """
from mtpmeta import MTPMetadata, ContextGPUView
from mtpmeta.bench.workload import StepConfig, make_steps, run_step
config = StepConfig()
meta = MTPMetadata(**config.metadata_kwargs())
meta.allocate("cpu")
view = ContextGPUView(config.max_requests, config.max_tokens, config.block_columns)
run_step(meta, view, make_steps(config, 1)[0], config)
"""


class PeakMemAllocate:
    params = [["direct", "mirror"]]
    param_names = ["path"]

    def peakmem_allocate_at_capacity(self, path):
        config = StepConfig()
        meta = MTPMetadata(**config.metadata_kwargs())
        meta.allocate(torch.device("cpu"), mirror=(path == "mirror"))
