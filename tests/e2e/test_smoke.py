"""The smallest end-to-end check: the real SDK creates a model on `carpool serve` and trains one step."""

from __future__ import annotations

import tinker
from tinker import types

from tests.e2e.server import Server


def test_sdk_trains_one_step(server: Server, base_model: str) -> None:
    key = server.create_tenant("smoke")
    client = tinker.ServiceClient(base_url=server.url, api_key=key)
    training = client.create_lora_training_client(base_model=base_model, rank=4).result()
    tokens = [1, 5, 9, 13, 17, 21]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    out = training.forward_backward([datum], "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert key not in server.log()
