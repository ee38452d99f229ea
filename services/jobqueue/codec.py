"""The bytes format of queued requests and stored results on Redis: one swappable codec, framed with a tag.

Everything that crosses Redis as an opaque blob goes through `encode` / `decode` here, and nowhere else,
so replacing the format (e.g. msgpack + an explicit numpy schema) is a change to this module only.

Trust boundary. The default codec is pickle, which runs arbitrary code while decoding. That is
acceptable only because every blob is written by our own processes (gateway enqueues, scheduler stores
results) into a Redis that is private to the deployment (no tenant reaches it; protect it with a network
policy and AUTH/ACLs). Tenants never supply these bytes: the gateway builds the payload from validated
wire types first. Never decode bytes that came from anywhere else (an upload, an HTTP body, a file).

Each blob starts with its codec's tag (`b"pickle5:"`), so a process never feeds bytes written by a
different codec to the wrong decoder (e.g. during a rolling upgrade that changes the format): it gets a
`CodecError` instead, which callers turn into an error result rather than a crashed loop.
"""

from __future__ import annotations

import pickle
from typing import Protocol, TypeVar

from services.jobqueue.protocol import StoredResult
from services.scheduler.requests import QueuedRequest

T = TypeVar("T")

TAG_SEPARATOR = b":"


class CodecError(ValueError):
    """Bytes that this process cannot (or must not) turn back into an object."""


class Codec(Protocol):
    """A serializer for our own domain objects (dataclasses holding numpy arrays)."""

    @property
    def tag(self) -> bytes:
        """Short name written in front of every blob; changes whenever the format does."""
        ...

    def dumps(self, obj: object) -> bytes: ...

    def loads(self, data: bytes) -> object: ...


class PickleCodec:
    """Pickle protocol 5: numpy arrays travel as raw buffers, dataclasses need no schema. Trusted peers only."""

    tag = b"pickle5"

    def dumps(self, obj: object) -> bytes:
        return pickle.dumps(obj, protocol=5)

    def loads(self, data: bytes) -> object:
        return pickle.loads(data)  # noqa: S301 - trusted writers only, see the module docstring


DEFAULT_CODEC: Codec = PickleCodec()


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
