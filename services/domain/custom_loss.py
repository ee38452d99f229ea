"""Server-side custom losses as plain data: the SDK's traced graph (protocol §4.11), checked, never executed here.

`ServiceClient.create_custom_loss` uploads a torch.fx trace encoded as JSON: nodes in execution order, each
naming an operation by its qualified name (`torch.exp`, `operator.mul`, a tensor method). Nothing in it is
code: the worker (worker/engine/custom_loss.py) rebuilds the computation from its own table of allowed
operations. This module owns what a tenant may send — the allow-list, the size limits and the structural
checks — so the control plane rejects a bad graph with a 4xx naming the node and the reason before anything
is stored, and the worker never sees one. Pure Python (no torch), like the rest of the domain.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_NODES = 256
"""Nodes in one graph (placeholders and output included): real losses use a few dozen."""
MAX_GRAPH_BYTES = 64 * 1024
"""Encoded size of one graph."""
MAX_ARG_DEPTH = 4
"""Nesting of tuples / lists / dicts inside one argument (`x[..., 0:1]` is depth 2)."""
MAX_ARG_ITEMS = 16
"""Items in one tuple / list / dict argument."""
MAX_INPUTS = 16
MAX_LOSSES_PER_SESSION = 64

# Functions by their wire name (`operator.*` is how the SDK names Python arithmetic and indexing).
ALLOWED_FUNCTIONS: frozenset[str] = frozenset({
    *(f"operator.{op}" for op in (
        "add", "sub", "mul", "truediv", "floordiv", "neg", "pos", "pow", "getitem", "lt", "le", "gt", "ge",
        "eq", "ne", "abs", "and_", "or_", "invert", "mod",
    )),
    *(f"torch.{fn}" for fn in (
        "exp", "log", "log1p", "expm1", "sum", "mean", "clamp", "clip", "minimum", "maximum", "where", "abs",
        "sigmoid", "tanh", "square", "sqrt", "rsqrt", "neg", "logsumexp", "softmax", "log_softmax", "zeros_like",
        "ones_like", "full_like", "sign", "min", "max", "amin", "amax", "relu", "exp2", "log2", "pow",
        "logical_and", "logical_or", "logical_not", "isfinite", "nan_to_num", "stack", "cat", "dot", "mul",
        "add", "sub", "div", "masked_fill", "numel", "argmax",
    )),
    *(f"torch.nn.functional.{fn}" for fn in ("relu", "softplus", "logsigmoid", "softmax", "log_softmax", "silu")),
    "torch._C._nn.log_sigmoid", "torch._C._nn.softplus", "torch._C._nn.gelu",
    "math.log", "math.exp", "math.sqrt",
})

# Tensor methods (`call_method`): pure elementwise or reductions; nothing that allocates by a size argument
# (`expand`, `repeat`, `new_zeros`) or leaves torch (`item`, `numpy`, `tolist`), and no in-place ops.
ALLOWED_METHODS: frozenset[str] = frozenset({
    "exp", "log", "log1p", "expm1", "sum", "mean", "clamp", "clip", "abs", "neg", "sigmoid", "tanh", "pow",
    "sqrt", "rsqrt", "square", "detach", "float", "double", "size", "dim", "unsqueeze", "squeeze", "min",
    "max", "amin", "amax", "logsumexp", "softmax", "log_softmax", "masked_fill", "where", "mul", "add", "sub",
    "div", "sign", "relu", "numel", "t", "transpose", "flatten", "gather", "argmax", "nan_to_num", "isfinite",
    "logical_not", "logical_and", "logical_or", "exp2", "log2", "reciprocal", "minimum", "maximum",
})

ALLOWED_CONSTANTS = {"dtype": {"float32", "float64", "int64", "bool"}, "device": {"cpu"},
                     "layout": {"strided"}, "memory_format": {"contiguous_format", "preserve_format"}}
_NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")


class InvalidCustomLoss(ValueError):
    """A graph outside what the server runs; `field` names the node (or part) and the message the reason."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class CustomLossInput:
    name: str
    rank: int
    """0 scalar, 1 `[T]`, 2 `[T, K]`."""


@dataclass(frozen=True)
class CustomLossNode:
    op: str
    name: str
    target: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CustomLossProgram:
    """A checked graph: `inputs[0]` is `logprobs`, the rest are `loss_fn_inputs` keys, in call order."""

    loss_id: str
    name: str
    inputs: tuple[CustomLossInput, ...]
    nodes: tuple[CustomLossNode, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs[1:])

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "inputs": [{"name": i.name, "rank": i.rank} for i in self.inputs],
                "nodes": [{"op": n.op, "name": n.name, "target": n.target, "args": n.args, "kwargs": n.kwargs}
                          for n in self.nodes]}

    @classmethod
    def from_json(cls, loss_id: str, doc: Mapping[str, Any]) -> CustomLossProgram:
        return build_program(loss_id, str(doc["name"]), doc["inputs"], doc["nodes"])


def build_program(loss_id: str, name: str, inputs: Sequence[Mapping[str, Any]],
                  nodes: Sequence[Mapping[str, Any]]) -> CustomLossProgram:
    """Check an uploaded graph against the allow-list and limits; raise `InvalidCustomLoss` naming the reason."""
    size = len(json.dumps({"inputs": list(inputs), "nodes": list(nodes)}, default=str))
    if size > MAX_GRAPH_BYTES:
        raise InvalidCustomLoss("graph", f"{size} bytes exceed the limit of {MAX_GRAPH_BYTES} bytes")
    if len(nodes) > MAX_NODES:
        raise InvalidCustomLoss("graph.nodes", f"{len(nodes)} nodes exceed the limit of {MAX_NODES}")
    declared = _inputs(inputs)
    checked = tuple(_node(i, n) for i, n in enumerate(nodes))
    _check_structure(declared, checked)
    return CustomLossProgram(loss_id=loss_id, name=name[:200], inputs=declared, nodes=checked)


def _inputs(inputs: Sequence[Mapping[str, Any]]) -> tuple[CustomLossInput, ...]:
    if not inputs or len(inputs) > MAX_INPUTS:
        raise InvalidCustomLoss("inputs", f"must list 1 to {MAX_INPUTS} inputs, logprobs first")
    out = []
    for i, item in enumerate(inputs):
        name, rank = item.get("name"), item.get("rank")
        if not isinstance(name, str) or not _INPUT_NAME.fullmatch(name):
            raise InvalidCustomLoss(f"inputs[{i}].name", "must be a lowercase identifier")
        if rank not in (0, 1, 2):
            raise InvalidCustomLoss(f"inputs[{i}].rank", "must be 0, 1 or 2")
        out.append(CustomLossInput(name, int(rank)))
    if out[0].name != "logprobs" or out[0].rank == 0:
        raise InvalidCustomLoss("inputs[0]", "must be logprobs with rank 1 or 2")
    if len({i.name for i in out}) != len(out):
        raise InvalidCustomLoss("inputs", "names must be unique")
    return tuple(out)


def _node(index: int, raw: Mapping[str, Any]) -> CustomLossNode:
    where = f"graph.nodes[{index}]"
    op, name, target = raw.get("op"), raw.get("name"), raw.get("target")
    if not isinstance(name, str) or not _NODE_NAME.fullmatch(name):
        raise InvalidCustomLoss(f"{where}.name", "must be an identifier of at most 128 characters")
    if not isinstance(target, str):
        raise InvalidCustomLoss(f"{where}.target", "must be a string")
    where = f"graph.nodes[{index}] ({name})"
    if op == "call_function" and target not in ALLOWED_FUNCTIONS:
        raise InvalidCustomLoss(where, f"operation {target!r} is not allowed in a server-side custom loss")
    if op == "call_method" and target not in ALLOWED_METHODS:
        raise InvalidCustomLoss(where, f"tensor method {target!r} is not allowed in a server-side custom loss")
    if op not in ("placeholder", "call_function", "call_method", "output"):
        raise InvalidCustomLoss(where, f"node kind {op!r} is not allowed (only placeholder, call_function, "
                                       "call_method and output)")
    args, kwargs = raw.get("args", []), raw.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise InvalidCustomLoss(where, "args must be a list and kwargs an object")
    for arg in [*args, *kwargs.values()]:
        _check_arg(arg, where, 0)
    return CustomLossNode(op=str(op), name=name, target=target, args=list(args), kwargs=dict(kwargs))


def _check_arg(arg: Any, where: str, depth: int) -> None:
    if depth > MAX_ARG_DEPTH:
        raise InvalidCustomLoss(where, f"arguments nest deeper than {MAX_ARG_DEPTH} levels")
    if arg is None or isinstance(arg, (bool, int, float, str)):
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > 2**31:
            raise InvalidCustomLoss(where, f"integer constant {arg} is out of range (|x| <= 2**31)")
        if isinstance(arg, str) and len(arg) > 128:
            raise InvalidCustomLoss(where, "string constants are limited to 128 characters")
        return
    items: list[Any]
    if isinstance(arg, list):
        items = arg
    elif isinstance(arg, dict) and len(arg) == 1:
        (kind, value), = arg.items()
        items = _encoded_items(kind, value, where)
    else:
        raise InvalidCustomLoss(where, f"argument {str(arg)[:80]!r} is not a value the graph format allows")
    if len(items) > MAX_ARG_ITEMS:
        raise InvalidCustomLoss(where, f"an argument holds {len(items)} items; the limit is {MAX_ARG_ITEMS}")
    for item in items:
        _check_arg(item, where, depth + 1)


def _encoded_items(kind: str, value: Any, where: str) -> list[Any]:
    if kind == "ref":
        if not isinstance(value, str):
            raise InvalidCustomLoss(where, "a ref must name a node")
        return []
    if kind in ("tuple", "slice") and isinstance(value, list):
        return value
    if kind == "dict" and isinstance(value, dict):
        return list(value.values())
    if kind == "ellipsis" and value is True:
        return []
    if kind == "float" and value in ("inf", "-inf", "nan"):
        return []
    if kind in ALLOWED_CONSTANTS and value in ALLOWED_CONSTANTS[kind]:
        return []
    raise InvalidCustomLoss(where, f"argument {{{kind!r}: {str(value)[:40]!r}}} is not allowed")


def refs(arg: Any) -> list[str]:
    """Every node name an encoded argument refers to."""
    if isinstance(arg, list):
        return [r for a in arg for r in refs(a)]
    if isinstance(arg, dict) and len(arg) == 1:
        (kind, value), = arg.items()
        if kind == "ref":
            return [value]
        if kind in ("tuple", "slice"):
            return refs(value)
        if kind == "dict":
            return refs(list(value.values()))
    return []


def _check_structure(inputs: tuple[CustomLossInput, ...], nodes: tuple[CustomLossNode, ...]) -> None:
    placeholders = [n.target for n in nodes if n.op == "placeholder"]
    if placeholders != [i.name for i in inputs]:
        raise InvalidCustomLoss("graph", f"placeholders {placeholders} must equal the declared inputs in order")
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        if node.name in seen:
            raise InvalidCustomLoss(f"graph.nodes[{i}]", f"node name {node.name!r} is used twice")
        for ref in refs(node.args) + refs(list(node.kwargs.values())):
            if ref not in seen:
                raise InvalidCustomLoss(f"graph.nodes[{i}] ({node.name})", f"refers to {ref!r} before it is defined")
        seen.add(node.name)
    if not nodes or nodes[-1].op != "output" or sum(n.op == "output" for n in nodes) != 1:
        raise InvalidCustomLoss("graph", "must end with exactly one output node")
    _check_output(nodes[-1])


def _check_output(node: CustomLossNode) -> None:
    out = node.args[0] if len(node.args) == 1 else None
    parts = out.get("tuple") if isinstance(out, dict) else out
    if not isinstance(parts, list) or len(parts) != 2 or not refs([parts[0]]) or not isinstance(parts[1], dict):
        raise InvalidCustomLoss("graph.output", "must return (loss, metrics)")
    metrics = parts[1].get("dict")
    if not isinstance(metrics, dict):
        raise InvalidCustomLoss("graph.output", "metrics must be a dict")
    for key in metrics:
        if not _METRIC_KEY.fullmatch(key):
            raise InvalidCustomLoss("graph.output", f"metric {key!r} must be named custom/<name>:sum or :mean")
