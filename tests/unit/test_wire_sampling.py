"""Sampling wire ⇄ domain: SDK-built `asample` bodies → `SampleWork`, and domain results → bytes the
SDK decodes and accepts (including its own post-checks on `prompt_logprobs_last_n`)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from tinker import types
from tinker.lib.public_interfaces.sampling_client import _check_prompt_logprobs_last_n_honored
from tinker.proto.response_conv import deserialize_sample_response

from services.domain import sampling as domain
from services.domain.training import AdapterId
from services.wire.errors import WireError, parse_request
from services.wire.proto import encode_sample_response
from services.wire.requests import SampleRequest
from services.wire.sampling import sample_response, sample_work, sampling_params_to_domain, stop_to_domain


def sdk_sample(**overrides: Any) -> SampleRequest:
    fields: dict[str, Any] = {
        "num_samples": 2,
        "prompt": types.ModelInput.from_ints([5, 6, 7, 8]),
        "sampling_params": types.SamplingParams(max_tokens=4, stop=["\n"], temperature=0.5, top_k=0),
        "sampling_session_id": "s:sample:0",
        "seq_id": 0,
        "prompt_logprobs": True,
        "topk_prompt_logprobs": 2,
    }
    fields.update(overrides)
    sdk = types.SampleRequest(**fields)
    return parse_request(SampleRequest, json.dumps(sdk.model_dump(exclude_none=True, mode="json")).encode())


def test_sample_work_from_sdk_body() -> None:
    work = sample_work(sdk_sample(), AdapterId("a"))
    assert work.adapter_id == "a" and work.num_samples == 2
    assert work.prompt.dtype == np.int64 and work.prompt.tolist() == [5, 6, 7, 8]
    assert work.params == domain.SamplingParams(max_tokens=4, temperature=0.5, top_k=-1, stop=("\n",))
    assert work.prompt_logprobs and work.topk_prompt_logprobs == 2


def test_stop_forms() -> None:
    assert stop_to_domain(None) is None
    assert stop_to_domain("x") == ("x",)
    assert stop_to_domain([]) == ()
    assert stop_to_domain([1, 2]) == (1, 2)
    with pytest.raises(WireError, match="non-empty"):
        stop_to_domain(["a", ""])
    with pytest.raises(WireError, match=">= 0"):
        stop_to_domain([-1])
    with pytest.raises(WireError, match="at most"):
        stop_to_domain(["a"] * 65)


def test_max_tokens_default() -> None:
    params = sdk_sample(sampling_params=types.SamplingParams()).sampling_params
    assert sampling_params_to_domain(params).max_tokens == domain.SamplingParams().max_tokens
    assert sampling_params_to_domain(params, default_max_tokens=99).max_tokens == 99


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"topk_sample_logprobs": 3}, "topk_sample_logprobs"),
        ({"prompt_alt_tokens_k": 1}, "prompt_alt_tokens_k"),
        (
            {"target_prompt_logprobs": {"data": [1, 2, 3], "dtype": "int64", "shape": [3, 1]}},
            "target_prompt_logprobs",
        ),
        ({"prompt_logprobs_last_n": 4}, "prompt_logprobs_last_n"),
        (
            {"prompt": types.ModelInput(chunks=[types.ImageChunk(data=b"x", format="png")])},
            "prompt.chunks[0]",
        ),
    ],
)
def test_unsupported_features_are_rejected(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(WireError) as err:
        sample_work(sdk_sample(**overrides), None)
    assert err.value.field == field


def test_sample_response_decodes_in_sdk_and_honours_last_n() -> None:
    result = domain.SampleResult(
        sequences=[
            domain.SampledSequence(tokens=[1, 2, 0], logprobs=[-0.1, -0.2, -0.3], stop_reason="stop"),
            domain.SampledSequence(tokens=[3, 4, 5, 6], logprobs=[], stop_reason="length"),
        ],
        prompt_logprobs=[None, -1.0, -2.0, -3.0],
        topk_prompt_logprobs=[None, [(9, -0.5)], [(8, -0.25), (7, -1.5)], [(6, -0.75)]],
    )
    wire = sample_response(result, topk_prompt_logprobs=2, prompt_logprobs_last_n=2)
    sdk = deserialize_sample_response(encode_sample_response(wire))
    _check_prompt_logprobs_last_n_honored(sdk, 2)
    assert [s.tokens for s in sdk.sequences] == [[1, 2, 0], [3, 4, 5, 6]]
    assert sdk.sequences[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert sdk.sequences[1].logprobs is None and sdk.sequences[1].stop_reason == "length"
    assert sdk.prompt_logprobs == [None, None, -2.0, -3.0]
    assert sdk.topk_prompt_logprobs == [None, None, [(8, -0.25), (7, -1.5)], [(6, -0.75)]]


def test_sample_response_without_prompt_scoring() -> None:
    result = domain.SampleResult(
        sequences=[domain.SampledSequence(tokens=[1], logprobs=[-0.5], stop_reason="stop")]
    )
    sdk = deserialize_sample_response(encode_sample_response(sample_response(result)))
    assert sdk.prompt_logprobs is None and sdk.topk_prompt_logprobs is None
    assert sdk.sequences[0].logprobs == [-0.5]


def test_mismatched_logprobs_are_a_server_bug() -> None:
    bad = domain.SampleResult(
        sequences=[domain.SampledSequence(tokens=[1, 2], logprobs=[-0.5], stop_reason="stop")]
    )
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        sample_response(bad)
