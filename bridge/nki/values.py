"""The values a kernel handles while it is being compiled.

`HBMTensor` is a kernel argument living in device memory, `Tile` an on-chip buffer region, and
`RuntimeScalar` an int32 read from a tensor while the binary runs. They carry shapes and dtypes only: no
data exists at compile time. Operators on tiles emit instructions through the active builder, so both the
AST frontend (beta3) and the tracer (beta2) get the same instructions from `a + b`.
"""

from __future__ import annotations

from types import ModuleType

import msgspec

from bridge.errors import KernelCompileError

# The kernel language (bridge.nki.language), which tiles' operators emit through: it imports this module, so
# it registers itself here as it loads (`use_language`) instead of being imported back. Tiles exist only
# while a kernel is traced, and every kernel module imports the language.
_language_module: ModuleType | None = None


def use_language(language: ModuleType) -> None:
    global _language_module
    _language_module = language


Region = tuple[tuple[int, int, int], ...]


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KernelCompileError(f"{what} must be a compile-time int, got {type(value).__name__}")
    return value


def normalize_slice(index: slice, size: int, axis: int) -> tuple[int, int, int]:
    """A static slice into an axis of `size`, bounds-checked like hardware access patterns, not clipped."""
    step = 1 if index.step is None else _as_int(index.step, "slice step")
    if step <= 0:
        raise KernelCompileError(f"slice step must be positive on axis {axis}, got {step}")
    start = 0 if index.start is None else _as_int(index.start, "slice start")
    stop = size if index.stop is None else _as_int(index.stop, "slice stop")
    if not 0 <= start < stop <= size:
        raise KernelCompileError(f"slice {start}:{stop} is out of bounds or empty for axis {axis} of size {size}")
    return (start, stop, step)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(len(range(start, stop, step)) for start, stop, step in region)


def normalize_index(index: object, ndim: int) -> tuple:
    """The index as a tuple, with a `...` expanded to the full slices it stands for."""
    index = index if isinstance(index, tuple) else (index,)
    ellipses = [i for i, item in enumerate(index) if item is Ellipsis]
    if len(ellipses) > 1:
        raise KernelCompileError("an index can have only one '...'")
    if ellipses:
        at = ellipses[0]
        index = index[:at] + (slice(None),) * max(0, ndim - len(index) + 1) + index[at + 1 :]
    return index


class RuntimeScalar(msgspec.Struct, frozen=True):
    """An int32 value that exists only when the binary runs, held in register `reg`."""

    reg: int

    def __index__(self) -> int:
        raise KernelCompileError("a runtime scalar has no value at compile time; use it only as an index")

    def __bool__(self) -> bool:
        raise KernelCompileError("a runtime scalar cannot drive compile-time control flow")


class HBMTensor(msgspec.Struct, frozen=True):
    """A kernel argument in device memory; indexing it gives an access for load and store."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    tensor_id: int
    is_output: bool = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: object) -> HBMAccess:
        return HBMAccess.build(self, normalize_index(index, self.ndim))


class HBMAccess(msgspec.Struct, frozen=True):
    """A region of an HBM tensor: static slices, static or runtime indices, and at most one gather."""

    tensor: HBMTensor
    entries: tuple  # encoded per bridge.nki.isa
    shape: tuple[int, ...]  # the shape of what this access reads or writes

    @classmethod
    def build(cls, tensor: HBMTensor, index: tuple) -> HBMAccess:
        if len(index) > tensor.ndim:
            raise KernelCompileError(f"too many indices for {tensor.name} of rank {tensor.ndim}")
        index = index + (slice(None),) * (tensor.ndim - len(index))
        entries, shape = [], []
        for axis, (item, size) in enumerate(zip(index, tensor.shape, strict=True)):
            entry, dims = _access_entry(item, size, axis, tensor.name)
            entries.append(entry)
            shape.extend(dims)
        if sum(1 for entry in entries if entry[0] == "g") > 1:
            raise KernelCompileError(f"at most one gather index per access of {tensor.name}")
        return cls(tensor, tuple(entries), tuple(shape))

    def encode(self) -> list:
        return [self.tensor.tensor_id, [list(entry) for entry in self.entries]]


def _access_entry(item: object, size: int, axis: int, name: str) -> tuple[tuple, list[int]]:
    if isinstance(item, slice):
        start, stop, step = normalize_slice(item, size, axis)
        return ("s", start, stop, step), [len(range(start, stop, step))]
    if isinstance(item, RuntimeScalar):
        return ("r", item.reg), []
    if isinstance(item, Tile):
        if item.dtype != "int32" or len(item.shape) != 2 or item.shape[1] != 1:
            raise KernelCompileError(
                f"a gather index into {name} must be an int32 [P, 1] tile, got {item.dtype}{list(item.shape)}"
            )
        return ("g", item.buf, [list(r) for r in item.region]), [item.shape[0]]
    index = _as_int(item, f"index into {name}")
    if not 0 <= index < size:
        raise KernelCompileError(f"index {index} is out of bounds for axis {axis} of {name} (size {size})")
    return ("i", index), []


class Tile(msgspec.Struct, frozen=True):
    """A region of an on-chip buffer. Axis 0 is the partition dim."""

    buf: int
    region: Region
    dtype: str
    space: str

    @property
    def shape(self) -> tuple[int, ...]:
        return region_shape(self.region)

    @property
    def ndim(self) -> int:
        return len(self.region)

    def ref(self) -> list:
        return [self.buf, [list(r) for r in self.region]]

    def operand(self) -> list:
        return ["t", self.buf, [list(r) for r in self.region]]

    def __getitem__(self, index: object) -> Tile:
        index = normalize_index(index, self.ndim)
        if len(index) > self.ndim:
            raise KernelCompileError(f"too many indices for a tile of rank {self.ndim}")
        index = index + (slice(None),) * (self.ndim - len(index))
        region = []
        for axis, (item, (start, stop, step)) in enumerate(zip(index, self.region, strict=True)):
            if isinstance(item, int) and not isinstance(item, bool):
                item = slice(item, item + 1)  # tiles keep their rank: t[:, j] is a [P, 1] column
            if not isinstance(item, slice):
                raise KernelCompileError("tiles are indexed by static slices and ints only")
            sub_start, sub_stop, sub_step = normalize_slice(item, len(range(start, stop, step)), axis)
            region.append((start + sub_start * step, start + sub_stop * step, step * sub_step))
        # Keep stops tight so equal views compare equal and encode the same way.
        region = [(s, s + (len(range(s, e, st)) - 1) * st + 1, st) for s, e, st in region]
        return Tile(self.buf, tuple(region), self.dtype, self.space)

    # Operators emit instructions through the language, which finds the active builder.
    def __add__(self, other):
        return _language().add(self, other)

    def __radd__(self, other):
        return _language().add(other, self)

    def __sub__(self, other):
        return _language().subtract(self, other)

    def __rsub__(self, other):
        return _language().subtract(other, self)

    def __mul__(self, other):
        return _language().multiply(self, other)

    def __rmul__(self, other):
        return _language().multiply(other, self)

    def __truediv__(self, other):
        return _language().divide(self, other)

    def __rtruediv__(self, other):
        return _language().divide(other, self)

    def __neg__(self):
        return _language().negative(self)

    def __iadd__(self, other):
        return _language().update(self, "add", other)

    def __isub__(self, other):
        return _language().update(self, "subtract", other)

    def __imul__(self, other):
        return _language().update(self, "multiply", other)

    def __itruediv__(self, other):
        return _language().update(self, "divide", other)

    def __setitem__(self, index: object, value: object) -> None:
        _language().assign(self[index], value)

    def __bool__(self) -> bool:
        raise KernelCompileError("a tile has no value at compile time; it cannot drive control flow")


def _language() -> ModuleType:
    if _language_module is None:
        raise KernelCompileError("tile operators need the kernel language: import bridge.nki.language")
    return _language_module
