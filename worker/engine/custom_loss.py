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

_OPERATORS = ("add", "sub", "mul", "truediv", "floordiv", "neg", "pos", "pow", "getitem", "lt", "le", "gt", "ge",
              "eq", "ne", "abs", "and_", "or_", "invert", "mod")
_TORCH = ("exp", "log", "log1p", "expm1", "sum", "mean", "clamp", "clip", "minimum", "maximum", "where", "abs",
          "sigmoid", "tanh", "square", "sqrt", "rsqrt", "neg", "logsumexp", "softmax", "log_softmax", "zeros_like",
          "ones_like", "full_like", "sign", "min", "max", "amin", "amax", "relu", "exp2", "log2", "pow",
          "logical_and", "logical_or", "logical_not", "isfinite", "nan_to_num", "stack", "cat", "dot", "mul",
          "add", "sub", "div", "masked_fill", "numel", "argmax")

FUNCTIONS: dict[str, Callable[..., Any]] = {
    **{f"operator.{name}": getattr(operator, name) for name in _OPERATORS},
    **{f"torch.{name}": getattr(torch, name) for name in _TORCH},
    "torch.nn.functional.relu": F.relu, "torch.nn.functional.softplus": F.softplus,
    "torch.nn.functional.logsigmoid": F.logsigmoid, "torch.nn.functional.softmax": F.softmax,
    "torch.nn.functional.log_softmax": F.log_softmax, "torch.nn.functional.silu": F.silu,
    "torch._C._nn.log_sigmoid": F.logsigmoid, "torch._C._nn.softplus": F.softplus, "torch._C._nn.gelu": F.gelu,
    "math.log": math.log, "math.exp": math.exp, "math.sqrt": math.sqrt,
}
"""Wire name → callable: exactly the domain's allow-list (checked at import below)."""

_CONSTANTS: dict[str, dict[str, Any]] = {
    "dtype": {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "bool": torch.bool},
    "device": {"cpu": "cpu"},
    "layout": {"strided": torch.strided},
    "memory_format": {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format},
}

if set(FUNCTIONS) != ALLOWED_FUNCTIONS:  # the two tables must describe the same operations
    raise RuntimeError(f"custom-loss tables disagree: {sorted(set(FUNCTIONS) ^ ALLOWED_FUNCTIONS)}")


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
    try:
        if op == "call_function":
            return FUNCTIONS[target](*args, **kwargs)
        if op == "call_method" and target in ALLOWED_METHODS and isinstance(args[0], torch.Tensor):
            return getattr(args[0], target)(*args[1:], **kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError) as exc:
        raise CustomLossError(f"node {name} ({target}) failed: {exc}") from None
    raise CustomLossError(f"node {name}: {op} {target!r} is not allowed")


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
