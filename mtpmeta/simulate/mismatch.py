"""``Mismatch``: the first disagreement the simulation found, with where and what."""

from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["Mismatch"]


class Mismatch(Exception):
    """A check failed. ``check`` names it (``"kv"``, ``"pad token"``, ...), ``detail``
    says what was compared; ``request``/``position`` locate it when it concerns one
    request; ``expected``/``got`` are short printable values. The engine fills in
    ``step`` and ``forward`` (e.g. ``"#41 draft depth 2"``) as the error passes out."""

    def __init__(self, check: str, detail: str, *, request: Optional[str] = None,
                 position: Optional[int] = None, expected: Any = None,
                 got: Any = None) -> None:
        super().__init__(detail)
        self.check = check
        self.detail = detail
        self.request = request
        self.position = position
        self.expected = expected
        self.got = got
        self.step: Optional[int] = None
        self.forward: Optional[str] = None

    def locate(self, step: int, forward: Optional[str]) -> "Mismatch":
        if self.step is None:
            self.step = step
        if self.forward is None:
            self.forward = forward
        return self

    def as_dict(self) -> Dict[str, Any]:
        return {"check": self.check, "detail": self.detail, "step": self.step,
                "forward": self.forward, "request": self.request,
                "position": self.position, "expected": _short(self.expected),
                "got": _short(self.got)}

    def describe(self) -> str:
        lines = [f"MISMATCH ({self.check}) at step {self.step}, forward "
                 f"{self.forward or '-'}: {self.detail}"]
        if self.request is not None:
            lines.append(f"  request:  {self.request}")
        if self.position is not None:
            lines.append(f"  position: {self.position}")
        if self.expected is not None or self.got is not None:
            lines.append(f"  expected: {_short(self.expected)}")
            lines.append(f"  got:      {_short(self.got)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _short(value: Any) -> Any:
    """Tensors become short lists of rounded numbers; everything else passes through."""
    if hasattr(value, "detach"):
        flat = value.detach().flatten().cpu().tolist()
        head = [round(v, 5) if isinstance(v, float) else v for v in flat[:6]]
        return head + ["..."] if len(flat) > 6 else head
    return value
