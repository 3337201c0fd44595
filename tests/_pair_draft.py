from tests.helpers import *  # DEV HEADER
from tests.helpers import BUFFER_NAMES, VIEW_FIELDS, Any, Dict  # DEV HEADER


# ------------------------------------------------------- differential driving (appended)
SCALAR_NAMES = ("forward_mode", "active_request_count", "padded_count", "graphed",
                "chunk_boundary_valid", "chunk_boundary_req_id", "chunk_boundary_position",
                "forward_active", "is_varlen_forward")


class Arg:
    """A test input as plain values plus a container form, built afresh for each side.

    container: "list" | "numpy" | "torch"; dtype: a torch dtype name ("int32", "bool",
    "bfloat16", ...); layout: "dense", "strided" (every other element of the last dim),
    "offset" (a slice ``[1:]`` of a longer array) or "transposed" (column-major 2-D).
    """

    def __init__(self, values: Any, container: str, dtype: str, layout: str = "dense",
                 shape: Any = None) -> None:
        self.values, self.container, self.dtype, self.layout = values, container, dtype, layout
        self.shape = (len(values),) if shape is None else shape

    def __repr__(self) -> str:
        return f"Arg({self.values!r}, {self.container}, {self.dtype}, {self.layout})"

    def build(self) -> Any:
        dense = torch.tensor(self.values, dtype=torch.float64).reshape(self.shape).to(
            getattr(torch, self.dtype))
        if self.container == "list" and dense.numel():
            return dense.tolist()
        if self.layout == "strided":
            wide = torch.full(dense.shape[:-1] + (2 * dense.shape[-1],), 7, dtype=dense.dtype)
            wide[..., ::2] = dense
            dense = wide[..., ::2]
        elif self.layout == "offset":
            longer = torch.full((dense.shape[0] + 1,) + dense.shape[1:], 7, dtype=dense.dtype)
            longer[1:] = dense
            dense = longer[1:]
        elif self.layout == "transposed" and dense.dim() == 2:
            dense = dense.t().contiguous().t()
        return dense.numpy() if self.container in ("numpy", "list") else dense


class Own:
    """Stands for each side's own persistent buffer ``name`` (e.g. the annotations)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Own({self.name})"


VIEW = Own("<view>")


def _alias(meta: Any, tensor: torch.Tensor) -> Any:
    """Which persistent buffer's memory ``tensor`` starts in, and where (None: none)."""
    for name in BUFFER_NAMES:
        buf = getattr(meta, name)
        if buf is not None and 0 <= tensor.data_ptr() - buf.data_ptr() < max(buf.nbytes, 1):
            return name, tensor.data_ptr() - buf.data_ptr(), tuple(tensor.shape), \
                tensor.stride()
    return None


def assert_results_equal(ours: Any, theirs: Any, lib: Any, ref: Any, what: str) -> None:
    if isinstance(ours, tuple) and isinstance(theirs, tuple) and len(ours) == len(theirs):
        for a, b in zip(ours, theirs):
            assert_results_equal(a, b, lib, ref, what)
    elif isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor):
        assert torch.equal(ours.cpu(), theirs.cpu()), f"{what}: {ours} != {theirs}"
        assert _alias(lib, ours) == _alias(ref, theirs), f"{what}: returned views differ"
    else:
        assert ours == theirs, f"{what}: returned {ours!r} vs {theirs!r}"


class DifferentialPair:
    """The library object and the reference, driven with identical freshly built inputs.

    ``call`` runs one method on both sides, checks that neither mutated its inputs, then
    scribbles over those inputs (so an aliased input shows up as a difference) and
    compares results, the ten view fields, every buffer and the scalar state.
    """

    def __init__(self, path: str, *, max_tokens: int = 128, junk_seed: int = 0,
                 **overrides: Any) -> None:
        self.path, self.overrides, self.max_tokens = path, overrides, max_tokens
        self.lib, self.ref = self._fresh_lib(), make_reference(**overrides)
        self.lib_view, self.ref_view = make_views(self.lib, max_tokens)
        gen = torch.Generator().manual_seed(junk_seed)
        for f in VIEW_FIELDS:  # identical junk: a stray write or a missed one shows
            junk = torch.randint(-9, 1000, getattr(self.lib_view, f.name).shape, generator=gen)
            getattr(self.lib_view, f.name).copy_(junk)
            getattr(self.ref_view, f.name).copy_(junk)
        self.check("construction")

    def _fresh_lib(self) -> MTPMetadata:  # mirror staging sized like the view
        lib = MTPMetadata(**config(**self.overrides))
        lib.allocate("cpu", mirror=(self.path == "mirror"), max_tokens=self.max_tokens)
        return lib

    def _sides(self):
        return ((self.lib, self.lib_view), (self.ref, self.ref_view))

    @staticmethod
    def _build(arg: Any, meta: Any, view: Any, memo: Dict[int, Any]) -> Any:
        if arg is VIEW:
            return view
        if isinstance(arg, Own):
            return getattr(meta, arg.name)
        if not isinstance(arg, Arg):
            return arg
        if id(arg) not in memo:  # one Arg given twice is one object (kv is q)
            memo[id(arg)] = (arg, arg.build())
        return memo[id(arg)][1]

    def call(self, method: str, *args: Any, raises: Any = None, **kwargs: Any) -> Any:
        results = []
        for meta, view in self._sides():
            memo: Dict[int, Any] = {}
            a = [self._build(x, meta, view, memo) for x in args]
            k = {key: self._build(x, meta, view, memo) for key, x in kwargs.items()}
            if raises is not None:
                try:
                    getattr(meta, method)(*a, **k)
                except raises:
                    pass
                else:
                    raise AssertionError(f"{type(meta).__name__}.{method}: no {raises}")
            else:
                results.append(getattr(meta, method)(*a, **k))
            for arg, built in memo.values():
                fresh = arg.build()
                assert repr(built) == repr(fresh) if isinstance(built, list) else \
                    torch.equal(torch.as_tensor(built), torch.as_tensor(fresh)), \
                    f"{method} mutated its input {arg!r}"
                if not isinstance(built, list):
                    torch.as_tensor(built).fill_(3)  # a kept alias would now differ
        if raises is None:
            assert_results_equal(results[0], results[1], self.lib, self.ref, method)
        self.check(method)
        return None if raises is not None else results[0]

    def check(self, where: str) -> None:
        try:
            assert_views_equal(self.lib_view, self.ref_view)
            assert_buffers_equal(self.lib, self.ref)
            for name in SCALAR_NAMES:
                ours, theirs = getattr(self.lib, name), getattr(self.ref, name)
                assert ours == theirs, f"{name}: {ours!r} vs {theirs!r}"
            for name in ("active_offsets", "active_block_table"):
                ours, theirs = getattr(self.lib, name), getattr(self.ref, name)
                assert (ours is None) == (theirs is None), f"{name}: {ours} vs {theirs}"
                if ours is not None:
                    assert_results_equal(ours, theirs, self.lib, self.ref, name)
        except AssertionError as exc:
            raise AssertionError(f"after {where}: {exc}") from None

    def reallocate(self) -> None:
        """The suspend/resume path on both sides, checked against fresh objects."""
        self.call("deallocate")
        self.lib.allocate("cpu", mirror=(self.path == "mirror"), max_tokens=self.max_tokens)
        self.ref.allocate("cpu")
        assert_buffers_equal(self.lib, self._fresh_lib())
        assert_buffers_equal(self.ref, make_reference(**self.overrides))
        for meta in (self.lib, self.ref):
            assert meta.forward_mode.name == "NONE" and not meta.chunk_boundary_valid
            assert meta.active_offsets is None and meta.active_block_table is None
        self.check("deallocate + allocate")
