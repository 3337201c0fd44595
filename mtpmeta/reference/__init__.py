"""The pure-torch oracle: upstream's op sequence, one small torch op per field.

``ReferenceMTPMetadata`` is the behaviour every fast path is tested against and the
baseline every benchmark ratio is measured against; ``ReferenceGPUView`` is upstream's
view layout. It shares no code with the library's fast paths, on purpose.
"""

from mtpmeta.reference.metadata import ReferenceMTPMetadata
from mtpmeta.reference.view import ReferenceGPUView

__all__ = ["ReferenceMTPMetadata", "ReferenceGPUView"]
