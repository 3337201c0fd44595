import numpy as np
import pytest

from tests.helpers import PATHS


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


@pytest.fixture(params=PATHS)
def path(request):
    """Both the direct path and the (CPU-forced) mirror path."""
    return request.param
