"""Evaluates a kernel's Python source from its AST, without ever running the kernel function.

This is the heart of the beta3 frontend. Compile-time Python (ints, floats, tuples, arithmetic, `if`,
`for` over ranges, calls to helper functions, `assert`) is evaluated here; calls into the kernel language
emit instructions into the active builder. Helper functions are inlined by interpreting their source too.
Anything else is rejected with the kernel name, the file and line, and the construct.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import math
import operator
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

import msgspec

from bridge.errors import KernelCompileError
from bridge.nki import language
from bridge.nki.values import HBMTensor, Tile

SUPPORTED = "assignments, if, for over ranges, helper calls, assert and return"
MAX_INLINE_DEPTH = 64

ALLOWED_BUILTINS: dict[str, object] = {
    name: getattr(builtins, name)
    for name in (
        "range",
        "len",
        "min",
        "max",
        "abs",
        "int",
        "float",
        "bool",
        "tuple",
        "list",
        "enumerate",
        "zip",
        "round",
        "divmod",
        "isinstance",
        "print",
    )
}
ALLOWED_MODULES = (language, math)
TENSOR_ATTRIBUTES = {"shape", "dtype", "ndim", "name"}

_BINARY_OPERATORS: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_IN_PLACE_OPS = {ast.Add: "add", ast.Sub: "subtract", ast.Mult: "multiply", ast.Div: "divide"}
_COMPARE_OPERATORS: dict[type, Callable] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}


class ParsedFunction(msgspec.Struct, frozen=True):
    node: ast.FunctionDef
    filename: str
    line_offset: int


@functools.lru_cache(maxsize=256)
def parse_function(code: types.CodeType, func: Callable) -> ParsedFunction:
    """The FunctionDef of `func`, parsed once per code object."""
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as exc:
        raise KernelCompileError(f"cannot read the source of {func.__qualname__}: {exc}") from None
    tree = ast.parse(source)
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        raise KernelCompileError(f"{func.__qualname__} is not a plain function definition")
    return ParsedFunction(node, display_path(inspect.getsourcefile(func) or "<unknown>"), code.co_firstlineno - 1)


def display_path(filename: str) -> str:
    path = Path(filename)
    root = Path(__file__).resolve().parents[2]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


class _Return(Exception):
    def __init__(self, value: object):
        self.value = value


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


class _Frame:
    """The local names of one function being interpreted."""

    def __init__(self, func: Callable, parsed: ParsedFunction, local_names: dict[str, object]):
        self.func = func
        self.parsed = parsed
        self.locals = local_names
        closure = func.__closure__ or ()
        self.closure = {name: cell.cell_contents for name, cell in zip(func.__code__.co_freevars, closure, strict=True)}

    def lookup(self, name: str) -> object:
        for scope in (self.locals, self.closure, self.func.__globals__, ALLOWED_BUILTINS):
            if name in scope:
                return scope[name]
        raise KernelCompileError(f"name {name!r} is not defined")


class KernelInterpreter:
    """Interprets one kernel (and the helpers it calls) for one specialization."""

    def __init__(self, kernel_name: str):
        self.kernel_name = kernel_name
        self.depth = 0
        self.kernel_module: str | None = None  # helpers are inlined from here and from bridge.kernels

    # -- calls ------------------------------------------------------------------------------------
    def call(self, func: Callable, args: tuple, kwargs: dict) -> object:
        """Interpret `func(*args, **kwargs)` from its source."""
        if self.depth >= MAX_INLINE_DEPTH:
            raise KernelCompileError(f"helper calls nest deeper than {MAX_INLINE_DEPTH} (recursion?)")
        if self.kernel_module is None:
            self.kernel_module = func.__module__
        parsed = parse_function(func.__code__, func)
        try:
            bound = inspect.signature(func).bind(*args, **kwargs)
        except TypeError as exc:
            raise KernelCompileError(f"bad call to {func.__name__}: {exc}") from None
        bound.apply_defaults()
        frame = _Frame(func, parsed, dict(bound.arguments))
        self.depth += 1
        try:
            self._exec_block(parsed.node.body, frame)
        except _Return as ret:
            return ret.value
        except (_Break, _Continue):
            raise self._error("break/continue outside a loop", frame, parsed.node) from None
        finally:
            self.depth -= 1
        return None

    def _call_value(self, func: object, args: list, kwargs: dict, frame: _Frame, node: ast.AST) -> object:
        if isinstance(func, types.FunctionType) and self._is_kernel_code(func):
            return self.call(func, tuple(args), kwargs)  # a helper: inline it
        if not self._may_call(func):
            name = getattr(func, "__qualname__", type(func).__name__)
            raise KernelCompileError(f"calling {name} is not supported in kernels ({SUPPORTED})")
        return func(*args, **kwargs)

    def _is_kernel_code(self, func: types.FunctionType) -> bool:
        """Helpers written beside the kernel or in the kernel library; anything else (shutil, numpy) is not
        kernel code and is rejected rather than interpreted."""
        module = func.__module__ or ""
        return module == self.kernel_module or module.startswith("bridge.kernels")

    @staticmethod
    def _may_call(func: object) -> TypeGuard[Callable[..., object]]:
        if any(func is allowed for allowed in ALLOWED_BUILTINS.values()):
            return True
        module = getattr(func, "__module__", None)
        if module == language.__name__:
            return True
        return module == "math" or (isinstance(func, types.BuiltinFunctionType) and func.__self__ is math)

    # -- statements -------------------------------------------------------------------------------
    def _exec_block(self, body: list[ast.stmt], frame: _Frame) -> None:
        for stmt in body:
            self._exec(stmt, frame)

    def _exec(self, stmt: ast.stmt, frame: _Frame) -> None:
        handler = getattr(self, f"_stmt_{type(stmt).__name__}", None)
        if handler is None:
            raise self._error(f"unsupported Python construct '{type(stmt).__name__}' ({SUPPORTED})", frame, stmt)
        try:
            handler(stmt, frame)
        except (_Return, _Break, _Continue):
            raise
        except KernelCompileError as exc:
            if exc.location is not None:
                raise
            raise self._error(exc.reason, frame, stmt, type(exc)) from None
        except (TypeError, ValueError, IndexError, KeyError, ZeroDivisionError, AttributeError) as exc:
            raise self._error(f"{type(exc).__name__}: {exc}", frame, stmt) from None

    def _stmt_Expr(self, stmt: ast.Expr, frame: _Frame) -> None:
        self._eval(stmt.value, frame)

    def _stmt_Pass(self, stmt: ast.Pass, frame: _Frame) -> None:
        pass

    def _stmt_Assign(self, stmt: ast.Assign, frame: _Frame) -> None:
        value = self._eval(stmt.value, frame)
        for target in stmt.targets:
            self._assign(target, value, frame)

    def _stmt_AnnAssign(self, stmt: ast.AnnAssign, frame: _Frame) -> None:
        if stmt.value is not None:
            self._assign(stmt.target, self._eval(stmt.value, frame), frame)

    def _stmt_AugAssign(self, stmt: ast.AugAssign, frame: _Frame) -> None:
        value = self._eval(stmt.value, frame)
        if isinstance(stmt.target, ast.Name):
            current = frame.lookup(stmt.target.id)
        elif isinstance(stmt.target, ast.Subscript):
            current = self._eval(stmt.target, frame)
        else:
            raise KernelCompileError(f"cannot update a {type(stmt.target).__name__} in place")
        if isinstance(current, Tile):
            op = _IN_PLACE_OPS.get(type(stmt.op))
            if op is None:
                raise KernelCompileError(f"tiles support +=, -=, *= and /=, not {type(stmt.op).__name__}")
            language.update(current, op, value)  # in place, so a view's buffer changes too
            return
        if not isinstance(stmt.target, ast.Name):
            raise KernelCompileError("only tiles can be updated through a subscript")
        frame.locals[stmt.target.id] = self._binary(stmt.op, current, value)

    def _stmt_If(self, stmt: ast.If, frame: _Frame) -> None:
        taken = stmt.body if self._truth(self._eval(stmt.test, frame)) else stmt.orelse
        self._exec_block(taken, frame)

    def _stmt_For(self, stmt: ast.For, frame: _Frame) -> None:
        iterable = self._eval(stmt.iter, frame)
        if not isinstance(iterable, range | tuple | list | enumerate | zip):
            raise KernelCompileError(
                f"for loops run over ranges (nl.affine_range, ...) or tuples, not {type(iterable).__name__}"
            )
        for item in iterable:
            self._assign(stmt.target, item, frame)
            try:
                self._exec_block(stmt.body, frame)
            except _Break:
                return
            except _Continue:
                continue
        self._exec_block(stmt.orelse, frame)

    def _stmt_Break(self, stmt: ast.Break, frame: _Frame) -> None:
        raise _Break

    def _stmt_Continue(self, stmt: ast.Continue, frame: _Frame) -> None:
        raise _Continue

    def _stmt_Return(self, stmt: ast.Return, frame: _Frame) -> None:
        raise _Return(None if stmt.value is None else self._eval(stmt.value, frame))

    def _stmt_Assert(self, stmt: ast.Assert, frame: _Frame) -> None:
        if not self._truth(self._eval(stmt.test, frame)):
            message = "assertion failed: " + ast.unparse(stmt.test)
            if stmt.msg is not None:
                message = str(self._eval(stmt.msg, frame))
            raise KernelCompileError(message)

    def _assign(self, target: ast.expr, value: object, frame: _Frame) -> None:
        if isinstance(target, ast.Name):
            frame.locals[target.id] = value
        elif isinstance(target, ast.Tuple | ast.List):
            values = list(value)  # type: ignore[call-overload]
            if len(values) != len(target.elts):
                raise KernelCompileError(f"cannot unpack {len(values)} values into {len(target.elts)} names")
            for element, item in zip(target.elts, values, strict=True):
                self._assign(element, item, frame)
        elif isinstance(target, ast.Subscript):
            container = self._eval(target.value, frame)
            if not isinstance(container, Tile):
                raise KernelCompileError("only tiles can be assigned into; HBM tensors are written with nl.store")
            language.assign(container[self._eval(target.slice, frame)], value)
        else:
            raise KernelCompileError(f"cannot assign to a {type(target).__name__}")

    @staticmethod
    def _truth(value: object) -> bool:
        return bool(value)  # tiles and runtime scalars raise a compile error here

    # -- expressions ------------------------------------------------------------------------------
    def _eval(self, node: ast.expr, frame: _Frame) -> object:
        handler = getattr(self, f"_expr_{type(node).__name__}", None)
        if handler is None:
            raise KernelCompileError(f"unsupported Python construct '{type(node).__name__}' ({SUPPORTED})")
        return handler(node, frame)

    def _expr_Constant(self, node: ast.Constant, frame: _Frame) -> object:
        return node.value

    def _expr_Name(self, node: ast.Name, frame: _Frame) -> object:
        return frame.lookup(node.id)

    def _expr_Attribute(self, node: ast.Attribute, frame: _Frame) -> object:
        value = self._eval(node.value, frame)
        if any(value is module for module in ALLOWED_MODULES):
            return getattr(value, node.attr)
        if isinstance(value, type) and value.__module__ == language.__name__:
            return getattr(value, node.attr)  # nl.tile_size.pmax
        if isinstance(value, HBMTensor | Tile) and node.attr in TENSOR_ATTRIBUTES:
            return getattr(value, node.attr)
        owner = f"module {value.__name__}" if isinstance(value, types.ModuleType) else type(value).__name__
        raise KernelCompileError(f"attribute .{node.attr} of {owner} is not available in kernels")

    def _expr_Subscript(self, node: ast.Subscript, frame: _Frame) -> object:
        value = self._eval(node.value, frame)
        if not isinstance(value, HBMTensor | Tile | tuple | list | range | str):
            raise KernelCompileError(f"cannot index a {type(value).__name__}")
        index: Any = self._eval(node.slice, frame)  # whatever the kernel wrote: the value it indexes checks it
        return value[index]

    def _expr_Slice(self, node: ast.Slice, frame: _Frame) -> slice:
        def part(child: ast.expr | None) -> object:
            return None if child is None else self._eval(child, frame)

        return slice(part(node.lower), part(node.upper), part(node.step))

    def _expr_Tuple(self, node: ast.Tuple, frame: _Frame) -> tuple:
        return tuple(self._elements(node.elts, frame))

    def _expr_List(self, node: ast.List, frame: _Frame) -> list:
        return self._elements(node.elts, frame)

    def _elements(self, elements: list[ast.expr], frame: _Frame) -> list:
        """The items of a tuple or list display; `*xs` splices a compile-time sequence in."""
        items: list = []
        for element in elements:
            if isinstance(element, ast.Starred):
                spliced = self._eval(element.value, frame)
                if not isinstance(spliced, tuple | list | range):
                    raise KernelCompileError(f"*{type(spliced).__name__} cannot be spliced; only tuples and lists")
                items.extend(spliced)
            else:
                items.append(self._eval(element, frame))
        return items

    def _expr_BinOp(self, node: ast.BinOp, frame: _Frame) -> object:
        return self._binary(node.op, self._eval(node.left, frame), self._eval(node.right, frame))

    @staticmethod
    def _binary(op: ast.operator, left: object, right: object) -> object:
        function = _BINARY_OPERATORS.get(type(op))
        if function is None:
            raise KernelCompileError(f"operator {type(op).__name__} is not supported in kernels")
        try:
            return function(left, right)
        except TypeError:
            raise KernelCompileError(
                f"operator {type(op).__name__} does not apply to {type(left).__name__} and {type(right).__name__}"
            ) from None

    def _expr_UnaryOp(self, node: ast.UnaryOp, frame: _Frame) -> object:
        operand = self._eval(node.operand, frame)
        if isinstance(node.op, ast.USub):
            return -operand  # type: ignore[operator]
        if isinstance(node.op, ast.UAdd):
            return +operand  # type: ignore[operator]
        if isinstance(node.op, ast.Not):
            return not self._truth(operand)
        raise KernelCompileError(f"operator {type(node.op).__name__} is not supported in kernels")

    def _expr_BoolOp(self, node: ast.BoolOp, frame: _Frame) -> object:
        is_and = isinstance(node.op, ast.And)
        value: object = None
        for child in node.values:
            value = self._eval(child, frame)
            if self._truth(value) != is_and:
                return value
        return value

    def _expr_Compare(self, node: ast.Compare, frame: _Frame) -> bool:
        left = self._eval(node.left, frame)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = self._eval(comparator, frame)
            if isinstance(left, Tile) or isinstance(right, Tile):
                raise KernelCompileError("tiles have no values at compile time and cannot be compared")
            if not _COMPARE_OPERATORS[type(op)](left, right):
                return False
            left = right
        return True

    def _expr_IfExp(self, node: ast.IfExp, frame: _Frame) -> object:
        return self._eval(node.body if self._truth(self._eval(node.test, frame)) else node.orelse, frame)

    def _expr_Call(self, node: ast.Call, frame: _Frame) -> object:
        func = self._eval(node.func, frame)
        args: list = []
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                args.extend(self._eval(arg.value, frame))  # type: ignore[arg-type]
            else:
                args.append(self._eval(arg, frame))
        kwargs = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                raise KernelCompileError("**kwargs calls are not supported in kernels")
            kwargs[keyword.arg] = self._eval(keyword.value, frame)
        return self._call_value(func, args, kwargs, frame, node)

    def _expr_JoinedStr(self, node: ast.JoinedStr, frame: _Frame) -> str:
        return "".join(str(self._eval(value, frame)) for value in node.values)

    def _expr_FormattedValue(self, node: ast.FormattedValue, frame: _Frame) -> str:
        value = self._eval(node.value, frame)
        spec = "" if node.format_spec is None else self._eval(node.format_spec, frame)
        return format(value, spec)  # type: ignore[arg-type]

    # -- errors -----------------------------------------------------------------------------------
    def _error(
        self, message: str, frame: _Frame, node: ast.AST, kind: type[KernelCompileError] = KernelCompileError
    ) -> KernelCompileError:
        line = getattr(node, "lineno", 0) + frame.parsed.line_offset
        return kind(message, kernel=self.kernel_name, location=f"{frame.parsed.filename}:{line}")
