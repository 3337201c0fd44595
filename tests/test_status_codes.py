"""The kernels' status codes: plain ints in ``native/`` (numba kernels return ints),
``IntEnum``s in ``mtpmeta.check_bounds``, the one module that decodes them.

Failure story: a code is renumbered or added in ``native/`` while ``check_bounds`` still
decodes the old numbers, so a refused input raises the wrong message, or none and the
call goes on to write.
"""

from __future__ import annotations

import pytest

from mtpmeta import native
from mtpmeta.check_bounds import CarryStatus, TokenStatus
from tests import naive


def _int_constants(module):
    return {name: value for name, value in vars(module).items()
            if name.isupper() and type(value) is int}


@pytest.mark.parametrize("enum,module,native_name", [
    (TokenStatus, native.staging, lambda m: "TOKENS_OK" if m == "OK" else m),
    (CarryStatus, native.carry, lambda m: "CARRY_" + m),
])
def test_every_kernel_status_code_has_one_enum_member_of_the_same_value(
        enum, module, native_name):
    """Each member equals the kernel module's constant of that name and the naive
    twin's restatement, and every int constant of the kernel module is a member."""
    constants = _int_constants(module)
    members = {native_name(member.name): int(member) for member in enum}
    assert members == constants
    for name, value in members.items():
        assert getattr(naive, name) == value, name
    assert enum(0).name == "OK"  # the fast paths test ``if code:``
