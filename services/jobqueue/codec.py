"""The bytes format of queued requests and stored results on Redis: one swappable codec, framed with a tag.

Everything that crosses Redis as an opaque blob (queued requests, results, replica calls and replies, the
durability journal) goes through `encode` / `decode` here, and nowhere else.

Trust boundary. Decoding must never run code chosen by whoever wrote the bytes: someone who can write to
Redis (a misconfigured network, a leaked password) must not thereby own every scheduler and worker. So
the format is msgpack plus an explicit schema, not pickle:

- plain values (None, bool, int, float, str, bytes, lists, maps) are msgpack's own;
- numpy arrays and scalars travel as dtype + shape + raw bytes, numeric dtypes only (no object arrays);
- tuples, sets, `Path`, `datetime` have an extension type each;
- a dataclass, `NamedTuple` or `Enum` travels as its qualified name plus its fields / value, and decodes
  only if that name is one of *our own* types (a class defined in a `services.*` module; nothing from
  elsewhere, no functions). Building one calls its constructor with data, as the gateway itself does.

Anything else is refused when encoding (`CodecError`), so a new payload type fails loudly in tests rather
than silently widening the format. Each blob starts with its codec's tag (`b"cpmsgpack1:"`), so a process
never feeds bytes written by a different codec (say, the pickle format of older releases during a rolling
upgrade) to the wrong decoder: it gets a `CodecError`, which callers turn into an error result rather than
a crashed loop.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import re
import sys
from datetime import datetime
from pathlib import Path, PurePath
from typing import Any, Protocol, TypeVar

import msgpack
import numpy as np

from services.jobqueue.protocol import StoredResult
from services.scheduler.requests import QueuedRequest

T = TypeVar("T")

TAG_SEPARATOR = b":"
TRUSTED_PACKAGE = "services"
"""Types are decoded only from modules of this package (the pure core, imported by every process)."""
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_NUMERIC_KINDS = frozenset("biufc")

_EXT_ARRAY, _EXT_SCALAR, _EXT_TUPLE, _EXT_OBJECT, _EXT_ENUM, _EXT_PATH, _EXT_DATETIME, _EXT_SET = range(1, 9)


class CodecError(ValueError):
    """Bytes that this process cannot (or must not) turn back into an object, or an object it cannot encode."""


class Codec(Protocol):
    """A serializer for our own domain objects (dataclasses holding numpy arrays)."""

    @property
    def tag(self) -> bytes:
        """Short name written in front of every blob; changes whenever the format does."""
        ...

    def dumps(self, obj: object) -> bytes: ...

    def loads(self, data: bytes) -> object: ...


class MsgpackCodec:
    """msgpack with an explicit schema for arrays and our own types (see the module docstring)."""

    tag = b"cpmsgpack1"

    def dumps(self, obj: object) -> bytes:
        try:
            return bytes(msgpack.packb(obj, default=_to_ext, use_bin_type=True, strict_types=True))
        except (TypeError, ValueError, OverflowError) as exc:
            raise CodecError(f"cannot encode {type(obj).__name__}: {exc}") from exc

    def loads(self, data: bytes) -> object:
        return msgpack.unpackb(data, ext_hook=_from_ext, raw=False, strict_map_key=False, use_list=True)


def _pack(obj: object) -> bytes:
    return bytes(msgpack.packb(obj, default=_to_ext, use_bin_type=True, strict_types=True))


def _to_ext(obj: Any) -> object:
    """The extension form of a value msgpack has no type for (strict: subclasses of int/str/... too)."""
    if isinstance(obj, np.ndarray):
        return msgpack.ExtType(_EXT_ARRAY, _pack([_numeric_dtype(obj.dtype), list(obj.shape),
                                                   np.ascontiguousarray(obj).tobytes()]))
    if isinstance(obj, np.generic):
        return msgpack.ExtType(_EXT_SCALAR, _pack([_numeric_dtype(obj.dtype), obj.tobytes()]))
    if isinstance(obj, enum.Enum):
        return msgpack.ExtType(_EXT_ENUM, _pack([_qualified(type(obj)), obj.value]))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return msgpack.ExtType(_EXT_OBJECT, _pack([_qualified(type(obj)), values]))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return msgpack.ExtType(_EXT_OBJECT, _pack([_qualified(type(obj)), obj._asdict()]))
    return _plain_ext(obj)


def _plain_ext(obj: Any) -> object:
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    if isinstance(obj, PurePath):
        return msgpack.ExtType(_EXT_PATH, _pack(str(obj)))
    if isinstance(obj, datetime):
        return msgpack.ExtType(_EXT_DATETIME, _pack(obj.isoformat()))
    if isinstance(obj, set | frozenset):
        return msgpack.ExtType(_EXT_SET, _pack([isinstance(obj, frozenset), list(obj)]))
    for base in (bool, int, float, str, bytes, dict, list):  # subclasses of builtins: as their base type
        if isinstance(obj, base):
            return base(obj)
    raise TypeError(f"{type(obj).__module__}.{type(obj).__qualname__} is not part of the codec's schema")


def _numeric_dtype(dtype: np.dtype) -> str:
    if dtype.kind not in _NUMERIC_KINDS:
        raise TypeError(f"only numeric arrays are encoded, got dtype {dtype}")
    return dtype.str


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _from_ext(code: int, data: bytes) -> object:
    value = msgpack.unpackb(data, ext_hook=_from_ext, raw=False, strict_map_key=False, use_list=True)
    if code == _EXT_ARRAY:
        dtype, shape, raw = value
        return np.frombuffer(raw, dtype=_checked_dtype(dtype)).reshape(shape).copy()
    if code == _EXT_SCALAR:
        dtype, raw = value
        return np.frombuffer(raw, dtype=_checked_dtype(dtype))[0]
    if code == _EXT_TUPLE:
        return tuple(value)
    if code == _EXT_PATH:
        return Path(value)
    if code == _EXT_DATETIME:
        return datetime.fromisoformat(value)
    if code == _EXT_SET:
        frozen, items = value
        return frozenset(items) if frozen else set(items)
    if code == _EXT_ENUM:
        name, raw_value = value
        return _trusted_type(name, enum.Enum)(raw_value)
    if code == _EXT_OBJECT:
        name, fields = value
        return _build(_trusted_type(name, object), fields)
    raise ValueError(f"unknown extension type {code}")


def _checked_dtype(text: str) -> np.dtype:
    dtype = np.dtype(text)
    if dtype.kind not in _NUMERIC_KINDS:
        raise ValueError(f"refusing dtype {text!r}")
    return dtype


def _trusted_type(name: str, kind: type) -> type:
    """The class `module:qualname`, only if it is a dataclass / NamedTuple / Enum of our own package."""
    module_name, _, qualname = name.partition(":")
    if not (module_name == TRUSTED_PACKAGE or module_name.startswith(TRUSTED_PACKAGE + ".")):
        raise ValueError(f"type {name!r} is outside the {TRUSTED_PACKAGE} package")
    if not _MODULE_NAME.fullmatch(module_name) or not qualname.isidentifier():
        raise ValueError(f"malformed type name {name!r}")
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    cls = getattr(module, qualname, None)
    if not isinstance(cls, type) or cls.__module__ != module_name or not issubclass(cls, kind):
        raise ValueError(f"{name!r} is not a type of this schema")
    if not (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum) or hasattr(cls, "_fields")):
        raise ValueError(f"{name!r} is neither a dataclass, a NamedTuple nor an Enum")
    return cls


def _build(cls: type, fields: dict[str, object]) -> object:
    if not dataclasses.is_dataclass(cls):
        return cls(**fields)  # a NamedTuple
    declared = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(fields) - set(declared)
    if unknown:
        raise ValueError(f"{cls.__qualname__} has no fields {sorted(unknown)}")
    obj = cls(**{k: v for k, v in fields.items() if declared[k].init})
    for key, value in fields.items():
        if not declared[key].init:
            object.__setattr__(obj, key, value)
    return obj


DEFAULT_CODEC: Codec = MsgpackCodec()


def encode(obj: object, codec: Codec = DEFAULT_CODEC) -> bytes:
    """`tag:body` for one object."""
    return codec.tag + TAG_SEPARATOR + codec.dumps(obj)


def decode(data: bytes, expected: type[T], codec: Codec = DEFAULT_CODEC) -> T:
    """The object in `data`, checked to be an `expected`; `CodecError` on a foreign tag, junk or wrong type."""
    tag, separator, body = bytes(data).partition(TAG_SEPARATOR)
    if not separator or tag != codec.tag:
        raise CodecError(f"blob tagged {tag[:32]!r}, this process decodes {codec.tag!r}")
    try:
        obj = codec.loads(body)
    except Exception as exc:  # any decoder failure means the same thing to callers: unusable bytes
        raise CodecError(f"undecodable {codec.tag.decode()} blob: {exc.__class__.__name__}: {exc}") from exc
    if not isinstance(obj, expected):
        raise CodecError(f"expected {expected.__name__}, decoded {type(obj).__name__}")
    return obj


def encode_request(request: QueuedRequest, codec: Codec = DEFAULT_CODEC) -> bytes:
    return encode(request, codec)


def decode_request(data: bytes, codec: Codec = DEFAULT_CODEC) -> QueuedRequest:
    return decode(data, QueuedRequest, codec)


def encode_result(result: StoredResult, codec: Codec = DEFAULT_CODEC) -> bytes:
    return encode(result, codec)


def decode_result(data: bytes, codec: Codec = DEFAULT_CODEC) -> StoredResult:
    return decode(data, StoredResult, codec)
