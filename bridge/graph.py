"""Graph files (DESIGN.md section 4): one JSON object per compilation pass.

`load_graph` validates everything a pass will touch, so that a bad file fails before any compile starts,
with an error naming the file, the op index and the problem.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path

import msgspec

from bridge import dtypes
from bridge.errors import NkiCacheError
from bridge.inputs import InputFileError, read_input, shown_path
from bridge.ir import ORDINARY_OPS, InternalNkiKernel, MacroOp, Tensor
from bridge.limits import DEFAULT_GRAPH_BYTES
from bridge.targets import TARGETS

GRAPH_KEYS = {"name", "target", "tensors", "ops"}
TENSOR_KEYS = {"shape", "dtype", "access_shape"}
KERNEL_OP_KEYS = {"type", "func_name", "kernel_name", "operands", "results", "attrs"}
ORDINARY_OP_KEYS = {"type", "operands", "results"}
MAX_GRAPH_BYTES = DEFAULT_GRAPH_BYTES  # the max_graph_bytes setting's default
MAX_GRAPH_NESTING = 32  # levels of JSON objects and lists; a graph needs about 6 (an attr of pairs in an op)


class GraphError(NkiCacheError):
    """A graph file is malformed; the message names the file, and the op index where there is one."""


class Graph(msgspec.Struct):
    name: str
    source: str  # the file it came from, or "<dict>"
    target: str | None = None
    tensors: dict[str, Tensor] = msgspec.field(default_factory=dict)
    ops: list[InternalNkiKernel | MacroOp] = msgspec.field(default_factory=list)

    @property
    def inputs(self) -> list[Tensor]:
        """Tensors no op produces: what a run of the graph must be given."""
        produced = {t.name for op in self.ops for t in op.results}
        return [t for name, t in self.tensors.items() if name not in produced]


def load_graph(
    path_or_dict: str | Path | Mapping, source: str | None = None, max_bytes: int = MAX_GRAPH_BYTES
) -> Graph:
    """Read and validate a graph file of at most `max_bytes` (or an already parsed graph object; `source` then
    names the file it came from, for errors and the default graph name, as if it had been read from there)."""
    if isinstance(path_or_dict, Mapping):
        return _build(path_or_dict, source or "<dict>")
    source = shown_path(path_or_dict)  # every message below names the file by it
    return _build(parse_graph_json(read_graph_file(path_or_dict, max_bytes), source), source)


def read_graph_file(path: str | Path, max_bytes: int = MAX_GRAPH_BYTES) -> bytes:
    """A graph file's bytes: a regular file of at most `max_bytes` (never a device nor a FIFO, which would
    never end or block), else a GraphError naming it."""
    try:
        return read_input(path, max_bytes, "graph file", "max_graph_bytes")
    except InputFileError as exc:
        raise GraphError(f"{shown_path(path)}: {exc}") from None


def parse_graph_json(data: bytes | str, source: str) -> Mapping:
    """A graph file's JSON object, or a GraphError naming `source`: invalid JSON or UTF-8, another type, or
    nesting deeper than any graph needs (deep nesting would otherwise exhaust Python's recursion, in the
    parser or later, and take the process down with a RecursionError instead of failing this one graph)."""
    try:
        document = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GraphError(f"{source}: not valid JSON: {exc}") from None
    except ValueError:  # Python's int-str limit (CVE-2020-10735): an integer no graph needs
        raise GraphError(f"{source}: holds an integer of more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:
        raise GraphError(f"{source}: JSON nested deeper than {MAX_GRAPH_NESTING} levels") from None
    if not isinstance(document, Mapping):
        raise GraphError(f"{source}: a graph file holds a JSON object, got {type(document).__name__}")
    if nesting(document, MAX_GRAPH_NESTING) > MAX_GRAPH_NESTING:
        raise GraphError(f"{source}: JSON nested deeper than {MAX_GRAPH_NESTING} levels")
    return document


def nesting(value: object, limit: int) -> int:
    """How deep maps and lists (or tuples) nest in `value`, found without recursing (deep nesting is the
    problem being guarded against); counting stops once it passes `limit`."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, list | tuple) else ()
        pending.extend((child, depth + 1) for child in children if isinstance(child, Mapping | list | tuple))
    return deepest


def _build(document: Mapping, source: str) -> Graph:
    _no_unknown_keys(document, GRAPH_KEYS, source, "graph")
    name = document.get("name", Path(source).stem)
    if not isinstance(name, str) or not name:
        raise GraphError(f"{source}: graph name must be a non-empty string")
    target = document.get("target")
    if target is not None and target not in TARGETS:
        raise GraphError(f"{source}: unknown target {target!r}; known: {', '.join(TARGETS)}")
    tensors = document.get("tensors", {})
    if not isinstance(tensors, Mapping):
        raise GraphError(f"{source}: 'tensors' must be an object of name -> {{shape, dtype}}")
    graph = Graph(name, source, target, {n: _tensor(n, spec, source) for n, spec in tensors.items()})
    ops = document.get("ops")
    if not isinstance(ops, list):
        raise GraphError(f"{source}: 'ops' must be a list")
    for index, op in enumerate(ops):
        graph.ops.append(_op(op, index, graph, source))
    _check_order(graph, source)
    return graph


def _check_order(graph: Graph, source: str) -> None:
    """Ops run in file order: an op may not read a tensor a later op produces, nor produce one twice."""
    producer: dict[str, int] = {}
    for index, op in enumerate(graph.ops):
        for tensor in op.results:
            if tensor.name in producer:
                raise GraphError(
                    f"{source}: op {index}: result {tensor.name!r} is already produced by op {producer[tensor.name]}"
                )
            producer.setdefault(tensor.name, index)
    for index, op in enumerate(graph.ops):
        for tensor in op.operands:
            if producer.get(tensor.name, -1) >= index:
                raise GraphError(
                    f"{source}: op {index}: operand {tensor.name!r} is read before op {producer[tensor.name]} "
                    "produces it (ops run in file order)"
                )


def _tensor(name: str, spec: object, source: str) -> Tensor:
    where = f"{source}: tensor {name!r}"
    if not isinstance(spec, Mapping):
        raise GraphError(f"{where}: must be an object with shape and dtype")
    _no_unknown_keys(spec, TENSOR_KEYS, source, f"tensor {name!r}")
    shape = _shape(spec.get("shape"), f"{where}: shape")
    dtype = spec.get("dtype")
    if dtype not in dtypes.ITEM_BYTES:
        raise GraphError(f"{where}: unsupported dtype {dtype!r}; supported: {', '.join(dtypes.ITEM_BYTES)}")
    access_shape = spec.get("access_shape")
    if access_shape is not None:
        access_shape = _shape(access_shape, f"{where}: access_shape")
        if math.prod(access_shape) > math.prod(shape):
            raise GraphError(f"{where}: access_shape {access_shape} has more elements than shape {shape}")
    return Tensor(name, shape, dtype, access_shape)


def _finite_attrs(attrs: Mapping, where: str) -> None:
    """JSON as Python reads it takes NaN and Infinity, which no kernel means: a GraphError naming the attr."""
    pending = [(name, value) for name, value in attrs.items()]
    while pending:  # nesting is bounded already (parse_graph_json); a loop all the same, as `nesting` is
        name, value = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise GraphError(f"{where}: attr {name!r} is {value}; attrs must be finite numbers")
        if isinstance(value, Mapping):
            pending.extend((name, item) for item in value.values())
        elif isinstance(value, list | tuple):
            pending.extend((name, item) for item in value)


def _op(op: object, index: int, graph: Graph, source: str) -> InternalNkiKernel | MacroOp:
    where = f"{source}: op {index}"
    if not isinstance(op, Mapping):
        raise GraphError(f"{where}: must be an object")
    kind = op.get("type")
    if kind == "InternalNkiKernel":
        _no_unknown_keys(op, KERNEL_OP_KEYS, source, f"op {index}")
        for key in ("func_name", "kernel_name"):
            if not isinstance(op.get(key), str) or not op[key]:
                raise GraphError(f"{where}: {key!r} must be a non-empty string")
        attrs = op.get("attrs", {})
        if not isinstance(attrs, Mapping):
            raise GraphError(f"{where}: 'attrs' must be an object")
        _finite_attrs(attrs, f"{where} ({op['func_name']})")
        operands = _operands(op, index, graph, source)
        results = _declared_results(op, index, graph, source)
        return InternalNkiKernel(op["func_name"], op["kernel_name"], operands, results, attrs)
    if kind in ORDINARY_OPS:
        _no_unknown_keys(op, ORDINARY_OP_KEYS, source, f"op {index}")
        cls = ORDINARY_OPS[kind]
        operands = _operands(op, index, graph, source)
        if len(operands) != cls.arity:
            raise GraphError(f"{where} ({kind}): takes {cls.arity} operands, got {len(operands)}")
        shapes = {t.shape for t in operands}
        if len(shapes) != 1 or len({t.dtype for t in operands}) != 1:
            raise GraphError(f"{where} ({kind}): operands must share shape and dtype, got {[t for t in operands]}")
        return cls(operands, _inferred_results(op, index, graph, source, operands[0]))
    known = ", ".join(["InternalNkiKernel", *ORDINARY_OPS])
    raise GraphError(f"{where}: unknown op type {kind!r}; known: {known}")


def _names(op: Mapping, key: str, where: str) -> list[str]:
    names = op.get(key)
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise GraphError(f"{where}: {key!r} must be a non-empty list of tensor names")
    return names


def _operands(op: Mapping, index: int, graph: Graph, source: str) -> list[Tensor]:
    where = f"{source}: op {index}"
    missing = [n for n in _names(op, "operands", where) if n not in graph.tensors]
    if missing:
        raise GraphError(f"{where}: operand {missing[0]!r} is neither declared nor produced by an earlier op")
    return [graph.tensors[n] for n in op["operands"]]


def _declared_results(op: Mapping, index: int, graph: Graph, source: str) -> list[Tensor]:
    where = f"{source}: op {index}"
    missing = [n for n in _names(op, "results", where) if n not in graph.tensors]
    if missing:
        raise GraphError(f"{where}: result {missing[0]!r} must be declared in 'tensors' (its shape is needed)")
    return [graph.tensors[n] for n in op["results"]]


def _inferred_results(op: Mapping, index: int, graph: Graph, source: str, like: Tensor) -> list[Tensor]:
    results = []
    for name in _names(op, "results", f"{source}: op {index}"):
        declared = graph.tensors.get(name)
        if declared is not None and (declared.shape, declared.dtype) != (like.shape, like.dtype):
            raise GraphError(f"{source}: op {index}: result {name!r} is declared {declared} but computes {like}")
        tensor = declared or Tensor(name, like.shape, like.dtype)
        graph.tensors[name] = tensor
        results.append(tensor)
    return results


def _shape(value: object, where: str) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value)
    ):
        raise GraphError(f"{where} must be a non-empty list of positive ints, got {value!r}")
    return tuple(value)


def _no_unknown_keys(document: Mapping, known: set[str], source: str, what: str) -> None:
    unknown = sorted(set(document) - known)
    if unknown:
        raise GraphError(f"{source}: {what}: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
