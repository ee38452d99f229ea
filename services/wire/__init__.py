"""The Tinker wire format (SDK 0.38) and its conversion to and from the domain.

Modules:
- `errors`: `WireError(field, message)`, `parse_request` (JSON body → model, failures as WireError).
- `inputs`: request building blocks (`TensorData`, `ModelInput`, `LoraConfig`, `AdamParams`,
  `SamplingParams`, ...) and the `WireRequest` / `WireResponse` bases (extra-key policy documented there).
- `requests`: model and sampler request bodies (`CreateModelRequest`, `SampleRequest`, ...).
- `control`: client plumbing bodies (client config, sessions, futures polling, telemetry).
- `responses`: JSON answers and future results (`UntypedAPIFuture`, `TryAgainResponse`, ...).
- `rest`: REST bodies (training runs, checkpoints, sessions, capabilities).
- `paths`: `tinker://` checkpoint paths, `sample_sequence_ids`, clone numbers of sampling seq ids.
- `arrays`: the decoded forward_backward call (`ForwardBackwardCall`) and shared tensor checks.
- `results`: numpy-form `ForwardBackwardOutput` / `SampleResponse`, metric-key checks.
- `proto`: protobuf (+zstd) decode of `ForwardBackwardRequest`, encode of the two proto results.
- `convert` / `sampling`: wire ⇄ domain for training and sampling.

This package is pure (no web or tensor frameworks); the SDK's protobuf module is imported only by
`proto`.
"""

from services.wire.arrays import DatumArrays, ForwardBackwardCall, InputChunk
from services.wire.convert import (
    adam_params,
    check_optimizer_config,
    decode_forward_backward_body,
    forward_backward_output,
    forward_backward_work,
    get_info_response,
    lora_spec,
    optim_step_response,
    request_failed,
)
from services.wire.errors import WireError, parse_request
from services.wire.proto import (
    CONTENT_TYPE_PROTOBUF,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)
from services.wire.results import ForwardBackwardOutput, SampledSequence, SampleResponse, TopkLogprobs
from services.wire.sampling import sample_response, sample_work

__all__ = [
    "CONTENT_TYPE_PROTOBUF",
    "DatumArrays",
    "ForwardBackwardCall",
    "ForwardBackwardOutput",
    "InputChunk",
    "SampleResponse",
    "SampledSequence",
    "TopkLogprobs",
    "WireError",
    "adam_params",
    "check_optimizer_config",
    "decode_forward_backward_body",
    "decode_forward_backward_request",
    "encode_forward_backward_output",
    "encode_sample_response",
    "forward_backward_output",
    "forward_backward_work",
    "get_info_response",
    "lora_spec",
    "optim_step_response",
    "parse_request",
    "request_failed",
    "sample_response",
    "sample_work",
]
