"""The e2e smoke, run by an *older* `tinker` SDK in its own interpreter (tests/compat/test_old_sdk.py).

Written for the API every release from 0.16 to 0.38 shares: train four steps, save the state, sample from
the trained weights. Prints one JSON line with the losses, the checkpoint path and the samples.
Usage: python old_sdk_smoke.py URL API_KEY BASE_MODEL
"""

from __future__ import annotations

import json
import sys

import tinker
from tinker import types


def main() -> None:
    url, key, base_model = sys.argv[1:4]
    service = tinker.ServiceClient(base_url=url, api_key=key)
    # Seeded: an unseeded adapter at this learning rate diverged once in four steps (a flaky "loss falls").
    training = service.create_lora_training_client(base_model=base_model, rank=4, seed=1)
    training = training.result() if hasattr(training, "result") else training  # newer SDKs answer a future
    tokens = [11, 23, 35, 47, 59, 71, 83]
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})]
    losses = []
    for _ in range(4):
        fb = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(float(fb.result().metrics["loss:sum"]))
        optim.result()
    path = training.save_state("old-sdk-state").result().path
    sampler = training.save_weights_and_get_sampling_client("old-sdk-sampler")
    out = sampler.sample(types.ModelInput.from_ints(tokens[:3]), 2, types.SamplingParams(max_tokens=4)).result()
    print(json.dumps({"version": tinker.__version__, "losses": losses, "path": path,
                      "samples": [list(s.tokens) for s in out.sequences]}))


if __name__ == "__main__":
    main()
