import numpy as np
import pytest
import torch

import mtpmeta.validation.checks as checks_module
import mtpmeta.validation.writer_inputs as writer_checks_module
from tests.helpers import PATHS


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


@pytest.fixture(params=PATHS)
def path(request):
    """Both the direct path and the (CPU-forced) mirror path."""
    return request.param


@pytest.fixture
def device_route(monkeypatch):
    """Treat every torch tensor as a device tensor inside MTPMetadata's routing."""
    for module in (checks_module, writer_checks_module):
        monkeypatch.setattr(module, "is_device_tensor",
                            lambda value, runtime=None: isinstance(value, torch.Tensor))
