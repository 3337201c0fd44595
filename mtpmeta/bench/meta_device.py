"""torch's ``meta`` device with its C++ meta kernels: the host's share of a GPU step.

On ``meta`` every op dispatches in full and moves no data, so a step's time there is
what the host pays to issue it. But ``torch/_meta_registrations.py`` registers Python
decompositions as the ``Meta`` kernels of about 1,300 aten ops, through one
``torch.library.Library("aten", "IMPL", "Meta")``; with them a ``cumsum`` on meta costs
hundreds of µs against a few on the CPU, and a launch-heavy path looks 10-20x slower
than it is. :func:`cpp_meta_kernels` destroys that library for the duration of a
``with`` block, so the C++ kernels serve, and restores every registration afterwards
(the rest of the process is unaffected; CPU kernels never change).

An op with no C++ ``Meta`` (nor ``CompositeExplicitAutograd``) kernel would then have
none. Those the measured paths use get a thin kernel with the C++ kernel's shape and
dtype rules (``floor_divide`` redirects to ``div(..., rounding_mode="floor")``;
``index_select``, ``where``, ``max``, ``logical_or.out``, ``repeat_interleave``,
``bucketize.out`` size their output directly); any other such op keeps its Python
kernel, and :func:`meta_setup_report` lists which the measured paths hit.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Iterator, List

import torch

__all__ = ["cpp_meta_kernels", "python_meta_active", "micro_us", "meta_setup_report"]


def _registry():
    import torch._meta_registrations as registrations

    return registrations


def _floor_divide(a: Any, b: Any, *, out: Any = None) -> torch.Tensor:
    if out is None:
        return torch.div(a, b, rounding_mode="floor")
    return torch.div(a, b, rounding_mode="floor", out=out)


def _shape(*values: Any):
    return torch.broadcast_shapes(*(v.shape for v in values if isinstance(v, torch.Tensor)))


def _index_select(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    shape = list(x.shape)
    if shape:
        shape[dim] = index.numel()
    return x.new_empty(shape)


def _where(condition: torch.Tensor, x: Any, y: Any) -> torch.Tensor:
    return torch.empty(_shape(condition, x, y), dtype=torch.result_type(x, y),
                       device="meta")


def _logical_or_out(x: torch.Tensor, y: Any, *, out: torch.Tensor) -> torch.Tensor:
    return out.resize_(_shape(x, y))


def _bucketize_out(x: torch.Tensor, boundaries: torch.Tensor, *, out_int32: bool = False,
                   right: bool = False, out: torch.Tensor) -> torch.Tensor:
    return out if out.shape == x.shape else out.resize_(x.shape)


def _repeat_interleave(repeats: torch.Tensor, *, output_size: Any = None) -> torch.Tensor:
    if output_size is None:
        raise RuntimeError("repeat_interleave on meta needs output_size")
    return repeats.new_empty((output_size,), dtype=torch.int64)


#: Thin meta kernels (the C++ kernels' shape and dtype rules: one Python hop, no
#: decomposition) for ops the measured paths use whose only meta kernel is Python.
_REDIRECTS: Dict[str, Callable[..., torch.Tensor]] = {
    "floor_divide": _floor_divide, "floor_divide.Scalar": _floor_divide,
    "floor_divide.out": _floor_divide, "index_select": _index_select,
    "where.self": _where, "max": lambda x: x.new_empty(()),
    "logical_or.out": _logical_or_out, "repeat_interleave.Tensor": _repeat_interleave,
    "bucketize.Tensor_out": _bucketize_out}


def _overload(entry: str):
    """``torch.ops.aten.<op>.<overload>`` of a Library entry ``"aten/op.overload/Meta"``."""
    name = entry.split("/")[1]
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _python_table() -> Dict[str, Any]:
    """The ops the Python meta library registers, by entry name, with their functions
    (the precedence of ``activate_meta``: meta, post_autograd, pre_autograd)."""
    from torch._decomp import global_decomposition_table

    lib = _registry()._meta_lib_dont_use_me_use_register_meta
    by_op: Dict[Any, Any] = {}
    for kind in ("meta", "post_autograd", "pre_autograd"):
        for op, fn in global_decomposition_table[kind].items():
            by_op.setdefault(op, fn)
    table = {}
    for entry in lib._op_impls:
        op = _overload(entry)
        table[entry] = (op, by_op[op])
    return table


def _has_cpp_kernel(op) -> bool:
    name = op.name()
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
               for key in ("Meta", "CompositeExplicitAutograd",
                           "CompositeExplicitAutogradNonFunctional"))


def python_meta_active() -> bool:
    """Whether ``cumsum``'s Meta kernel is the Python registration (stock torch)."""
    lib = _registry()._meta_lib_dont_use_me_use_register_meta
    return getattr(lib, "m", None) is not None and "aten/cumsum/Meta" in lib._op_impls


@contextlib.contextmanager
def cpp_meta_kernels() -> Iterator[Dict[str, List[str]]]:
    """Serve meta ops by their C++ kernels inside the block; restore on exit.

    Yields ``{"redirected": [...], "kept_python": [...]}``: the ops given a thin
    redirect and those left with their Python kernel (no C++ one exists)."""
    registrations = _registry()
    table = _python_table()
    registrations._meta_lib_dont_use_me_use_register_meta._destroy()
    own = torch.library.Library("aten", "IMPL", "Meta")
    info: Dict[str, List[str]] = {"redirected": [], "kept_python": []}
    try:
        for entry, (op, fn) in sorted(table.items()):
            if _has_cpp_kernel(op):
                continue
            short = entry.split("/")[1]
            if short in _REDIRECTS:
                own.impl(op, _REDIRECTS[short])
                info["redirected"].append(short)
            else:
                own.impl(op, fn)
                info["kept_python"].append(short)
        yield info
    finally:
        own._destroy()
        restored = torch.library.Library("aten", "IMPL", "Meta")
        for op, fn in table.values():
            restored.impl(op, fn)
        registrations._meta_lib_dont_use_me_use_register_meta = restored


def micro_us(number: int = 200) -> Dict[str, float]:
    """µs per call of ``cumsum`` and ``floor_divide`` on meta ``[256]`` tensors, as the
    current registrations serve them."""
    x = torch.ones(256, dtype=torch.int64, device="meta")
    out = {}
    for name, call in (("cumsum", lambda: torch.cumsum(x, 0)),
                       ("floor_divide", lambda: x // 64)):
        call()
        start = time.perf_counter_ns()
        for _ in range(number):
            call()
        out[name] = (time.perf_counter_ns() - start) / number / 1e3
    return out


def meta_setup_report(used_ops: List[Any], info: Dict[str, List[str]]) -> Dict[str, Any]:
    """Which of ``used_ops`` (OpOverloads a replay dispatched on meta) still run a
    Python meta kernel or the redirect, for the printed setup line."""
    names = {f"{op._schema.name.split('::')[1]}"
             + (f".{op._overloadname}" if op._overloadname != "default" else "")
             for op in used_ops}
    return {"redirected_used": sorted(names & set(info["redirected"])),
            "python_used": sorted(names & set(info["kept_python"]))}
