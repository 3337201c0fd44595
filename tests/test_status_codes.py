"""The kernels' status codes: plain ints in ``native/`` (numba kernels return ints),
``IntEnum``s in ``mtpmeta.validation.bounds``, the one module that decodes them.

Failure story: a code is renumbered or added in ``native/`` while ``mtpmeta.validation.bounds`` still
decodes the old numbers, so a refused input raises the wrong message, or none and the
call goes on to write.
"""

from __future__ import annotations

import pytest

from mtpmeta import native
from mtpmeta.validation.bounds import CarryStatus, TokenStatus
from tests import naive


# The block-id scans' codes (``first_bad_token_block`` / ``first_bad_commit_block``),
# defined beside the token codes in ``staging``; ``mtpmeta.validation.checks`` reads them by name.
BLOCK_CODES = {"BLOCKS_OK": 0, "INHERITED_OUT_OF_RANGE": 1, "BAD_WRITTEN_BLOCK": 2}


def _int_constants(module):
    return {name: value for name, value in vars(module).items()
            if name.isupper() and type(value) is int and name not in BLOCK_CODES}


def test_the_block_scan_codes_are_ok_zero_and_distinct():
    """The block scans' codes: OK is the only falsy one (the callers test ``if code:``)
    and ``native.checks`` re-exports the very values ``staging`` defines."""
    for name, value in BLOCK_CODES.items():
        assert getattr(native.staging, name) == value, name
        assert getattr(native.checks, name) == value, name


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
