import contextlib

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


def pytest_addoption(parser):
    parser.addoption(
        "--inference-mode", action="store_true",
        help="run each test's body inside torch.inference_mode(), where Megatron's "
             "controller calls the MTP helpers (fixtures stay outside it, as an engine "
             "builds its context outside it)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    inside = item.config.getoption("--inference-mode")
    with torch.inference_mode() if inside else contextlib.nullcontext():
        yield
