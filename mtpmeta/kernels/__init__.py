"""The one door to the numba kernels of ``native/``.

``native`` (``loader``) is the kernels' package; ``entry`` calls a kernel without its
dispatcher and passes its optional arrays; ``counted`` runs the block-count kernels of a
commit pass.
Nothing here imports torch-side modules of the library: the layers above call in.
"""

from mtpmeta.kernels.loader import native

__all__ = ["native"]
