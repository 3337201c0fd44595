"""The grad mode of the tensors the library keeps past a call.

Megatron's controller runs the MTP helpers inside ``torch.inference_mode()``, and a
scheduler may call outside it too (a warm-up, a reset, a test). A tensor made inside
inference mode, and a dtype view (``view(dtype)``) made there even of a normal tensor,
is an inference tensor, which no later call outside inference mode may write in place.
Upstream's buffers are all made at construction, so they take calls in either mode, in
any order (when constructed outside it); the library's buffers (those ``allocate``
makes and those made lazily), scratch and cached dtype views are made outside
inference mode (``kept_tensors``), so they take calls in either mode wherever made.
Slices, reshapes and other views of a normal tensor stay normal in any mode, so only
allocations and dtype views need it.
"""

from __future__ import annotations

import torch

__all__ = ["kept_tensors", "kept_dtype_view"]


def kept_tensors() -> torch.inference_mode:
    """The context to make a kept tensor in: outside inference mode, whatever mode the
    call runs in (about 2 µs; the buffers made in it are made once).

    >>> with torch.inference_mode(), kept_tensors():
    ...     torch.zeros(2).is_inference()
    False
    """
    return torch.inference_mode(False)


def kept_dtype_view(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.view(dtype)``, a normal tensor in any mode (a dtype view of an inference
    tensor included). Outside inference mode it costs one mode query more.

    >>> with torch.inference_mode():
    ...     kept_dtype_view(torch.zeros(2, dtype=torch.int64), torch.int32).is_inference()
    False
    """
    if torch.is_inference_mode_enabled():
        with kept_tensors():
            return tensor.view(dtype)
    return tensor.view(dtype)
