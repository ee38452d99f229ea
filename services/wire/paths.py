"""Wire formats of references (§5.6): `tinker://<training_run_id>/<segment>/<name>` checkpoint paths,
the `sample_sequence_ids` of an `asample` promise, and the clone number hidden in sampling seq ids.

The training-run / sampling-session id schemes (`{session}:train:{n}`, `{session}:sample:{k}`) are part
of the contract too (the SDK computes the former itself for create-via-load); they are minted by
`services.db.ids`, not duplicated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.wire.errors import WireError

CheckpointType = Literal["training", "sampler", "external"]
TINKER_SCHEME = "tinker://"
CLONE_SEQ_STRIDE = 1_000_000_000
"""Cloned SamplingClients number their requests `clone_id * CLONE_SEQ_STRIDE + n`."""

SEGMENT_TO_TYPE: dict[str, CheckpointType] = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}
TYPE_TO_SEGMENT: dict[CheckpointType, str] = {v: k for k, v in SEGMENT_TO_TYPE.items()}


def sample_sequence_ids(request_id: str, num_samples: int) -> list[str]:
    """The `sample_sequence_ids` of an `asample` promise: one per sample, in output order."""
    return [f"{request_id}:{i}" for i in range(num_samples)]


def cloned_sampler_id(seq_id: int) -> int:
    """Which clone of a sampling client sent `seq_id` (0 = the original), for `retrieve_futures`."""
    return seq_id // CLONE_SEQ_STRIDE


@dataclass(frozen=True)
class TinkerPath:
    """A parsed checkpoint path `tinker://<training_run_id>/<segment>/<name>`."""

    training_run_id: str
    checkpoint_type: CheckpointType
    name: str

    @property
    def segment(self) -> str:
        """`weights`, `sampler_weights` or `external_weights`."""
        return TYPE_TO_SEGMENT[self.checkpoint_type]

    @property
    def checkpoint_id(self) -> str:
        """`<segment>/<name>`, the id used in REST paths."""
        return f"{self.segment}/{self.name}"

    @property
    def uri(self) -> str:
        """The `tinker://` form."""
        return f"{TINKER_SCHEME}{self.training_run_id}/{self.checkpoint_id}"


def checkpoint_path(training_run_id: str, checkpoint_type: CheckpointType, name: str) -> str:
    """Build `tinker://<training_run_id>/<segment>/<name>`."""
    return TinkerPath(training_run_id, checkpoint_type, name).uri


def parse_tinker_path(path: str, field: str = "path") -> TinkerPath:
    """Parse a checkpoint path like the SDK's `ParsedCheckpointTinkerPath.from_tinker_path`.

    Raises `WireError(field, ...)` unless it is `tinker://` + exactly three non-empty `/` parts with a
    known segment.
    """
    if not path.startswith(TINKER_SCHEME):
        raise WireError(field, f"must start with {TINKER_SCHEME!r}, got {path!r}")
    parts = path[len(TINKER_SCHEME) :].split("/")
    if len(parts) != 3 or not all(parts):
        raise WireError(field, f"must be tinker://<training_run_id>/<segment>/<name>, got {path!r}")
    run_id, segment, name = parts
    checkpoint_type = SEGMENT_TO_TYPE.get(segment)
    if checkpoint_type is None:
        raise WireError(field, f"segment must be one of {sorted(SEGMENT_TO_TYPE)}, got {segment!r}")
    if name in (".", ".."):
        raise WireError(field, f"checkpoint name must not be {name!r}")
    return TinkerPath(run_id, checkpoint_type, name)


def parse_checkpoint_id(training_run_id: str, checkpoint_id: str, field: str = "checkpoint_id") -> TinkerPath:
    """Parse the `<segment>/<name>` REST path parameter of a run's checkpoint."""
    return parse_tinker_path(f"{TINKER_SCHEME}{training_run_id}/{checkpoint_id}", field)
