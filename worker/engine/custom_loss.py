"""Interpreter of server-side custom losses: runs a checked `CustomLossProgram` on one datum's logprobs.

The program is plain data (services/domain/custom_loss.py checked it against the allow-list and the size
limits when it was created). Here every wire name is looked up in this module's own tables of torch
callables — never `eval`, `getattr` on a module by a tenant's string, or unpickling — so a name outside the
tables cannot run, even if a program somehow skipped the checks. The result equals the SDK's client-side
`forward_backward_custom` with the same function: the loss is the sum over datums of the per-datum scalar,
and its gradient flows into the pass's logprobs like any built-in loss.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from services.domain.custom_loss import ALLOWED_FUNCTIONS, ALLOWED_METHODS, CustomLossProgram, InvalidCustomLoss

MAX_ELEMENTS = 1 << 25
"""Largest intermediate tensor of a custom loss (32 Mi elements, 128 MiB in fp32): a datum's inputs are at
most a few million elements, so anything bigger is a broadcast blow-up, refused before it allocates."""

_MODULES: dict[str, Any] = {"operator": operator, "torch": torch, "torch.nn.functional": F, "math": math}
_NATIVE: dict[str, Callable[..., Any]] = {
    # How torch.fx names these functional ops (their C implementations).
    "torch._C._nn.log_sigmoid": F.logsigmoid, "torch._C._nn.softplus": F.softplus, "torch._C._nn.gelu": F.gelu,
}


def _resolve(name: str) -> Callable[..., Any]:
    if name in _NATIVE:
        return _NATIVE[name]
    module, _, attr = name.rpartition(".")
    function: Callable[..., Any] = getattr(_MODULES[module], attr)
    return function


FUNCTIONS: dict[str, Callable[..., Any]] = {name: _resolve(name) for name in ALLOWED_FUNCTIONS}
"""Wire name → callable, built once at import from the domain's allow-list (constants, never a tenant's
string): a name outside it has no entry, so it cannot be called."""

_CONSTANTS: dict[str, dict[str, Any]] = {
    "dtype": {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "bool": torch.bool},
    "device": {"cpu": "cpu"},
    "layout": {"strided": torch.strided},
    "memory_format": {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format},
}

class CustomLossError(ValueError):
    """A program that failed on a datum (bad shapes, non-scalar loss): the request fails, the pass does not."""


def run_custom_loss(program: CustomLossProgram, logprobs: torch.Tensor,
                    inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One datum's (scalar loss, metrics); differentiable in `logprobs`."""
    env: dict[str, Any] = {}
    args_of = {"logprobs": logprobs, **{name: inputs[name] for name in program.input_names}}
    for node in program.nodes:
        if node.op == "placeholder":
            env[node.name] = args_of[node.target]
        elif node.op == "output":
            loss, metrics = _decode(node.args[0], env)
            return _checked(program, loss, metrics)
        else:
            args = [_decode(a, env) for a in node.args]
            kwargs = {k: _decode(v, env) for k, v in node.kwargs.items()}
            env[node.name] = _call(node.op, node.target, args, kwargs, node.name)
    raise CustomLossError(f"loss {program.name!r} has no output node")


def _call(op: str, target: str, args: list[Any], kwargs: dict[str, Any], name: str) -> Any:
    tensors = [a for a in _leaves([*args, *kwargs.values()]) if isinstance(a, torch.Tensor)]
    _check_operands(target, args, tensors, name)
    try:
        if op == "call_function":
            result = FUNCTIONS[target](*args, **kwargs)
        elif op == "call_method" and target in ALLOWED_METHODS and isinstance(args[0], torch.Tensor):
            result = getattr(args[0], target)(*args[1:], **kwargs)
        else:
            raise CustomLossError(f"node {name}: {op} {target!r} is not allowed")
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, ArithmeticError) as exc:
        raise CustomLossError(f"node {name} ({target}) failed: {exc}") from None
    if isinstance(result, torch.Tensor) and result.numel() > MAX_ELEMENTS:
        raise CustomLossError(f"node {name} ({target}) made {result.numel()} elements; the limit is {MAX_ELEMENTS}")
    return result


def _check_operands(target: str, args: list[Any], tensors: list[torch.Tensor], name: str) -> None:
    """Refuse what could exhaust memory or time before it runs: Python arithmetic on non-tensors (`[0] * n`,
    `2 ** n`: a traced loss only has tensor arithmetic, Python's is folded while tracing) and broadcasts
    beyond `MAX_ELEMENTS` (`x[:, None] * x[None, :]` on long inputs)."""
    if target.startswith("operator.") and target != "operator.getitem" and not tensors:
        raise CustomLossError(f"node {name} ({target}): arithmetic needs a tensor operand")
    if target == "operator.getitem" and not isinstance(args[0], torch.Tensor | tuple | torch.Size):
        raise CustomLossError(f"node {name}: only tensors and shapes can be indexed")
    if len(tensors) > 1:
        try:
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        except RuntimeError:
            return  # not an elementwise combination (matmul, gather...): the result check applies
        if math.prod(shape) > MAX_ELEMENTS:
            raise CustomLossError(f"node {name} ({target}) would make {math.prod(shape)} elements; the limit "
                                  f"is {MAX_ELEMENTS}")


def _leaves(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if isinstance(value, list | tuple):
            out.extend(_leaves(list(value)))
        elif isinstance(value, dict):
            out.extend(_leaves(list(value.values())))
        else:
            out.append(value)
    return out


def _decode(arg: Any, env: Mapping[str, Any]) -> Any:
    if isinstance(arg, list):
        return [_decode(a, env) for a in arg]
    if not isinstance(arg, dict):
        return arg
    (kind, value), = arg.items()
    if kind == "ref":
        return env[value]
    if kind == "tuple":
        return tuple(_decode(a, env) for a in value)
    if kind == "dict":
        return {k: _decode(v, env) for k, v in value.items()}
    if kind == "slice":
        return slice(*(_decode(a, env) for a in value))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(value)
    if kind in _CONSTANTS and value in _CONSTANTS[kind]:
        return _CONSTANTS[kind][value]
    raise InvalidCustomLoss("graph", f"argument kind {kind!r} is not allowed")


def _checked(program: CustomLossProgram, loss: Any,
             metrics: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise CustomLossError(f"loss {program.name!r} must return a scalar loss, got {shape}")
    out = {}
    for key, value in metrics.items():
        out[key] = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    return loss, out
