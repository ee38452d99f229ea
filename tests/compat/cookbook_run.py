"""tinker-cookbook's own training loops against `carpool serve`, run in the cookbook's test venv.

tests/compat/test_cookbook.py runs this script with the interpreter of `.cache/cookbook-<version>` (the
cookbook installed `--no-deps` beside the project's packages). Nothing of Carpool is imported here: this is
the cookbook as its users run it, pointed at our server through `base_url` and `TINKER_API_KEY`.

- `sl`: `tinker_cookbook.supervised.train.main` on a chat JSONL written by the test
  (`FromConversationFileBuilder`, the cookbook's local-file dataset, no hub).
- `rl`: `tinker_cookbook.rl.train.main` on a toy `ProblemEnv` defined here (answer with a colour word).

The one hub boundary: the cookbook loads tokenizers by hub id (`get_tokenizer(model_name)`); the
cookbook's own `register_tokenizer` hook points that id at the local tokenizer directory instead.
Both loops resume from `log_path` when it holds checkpoints (the cookbook's `checkpoints.jsonl`).
Usage: python cookbook_run.py sl|rl URL MODEL_NAME TOKENIZER_DIR LOG_PATH ARGS_JSON
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import chz
from tinker_cookbook import renderers
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer
from transformers import AutoTokenizer

RENDERER = "role_colon"  # plain "User: ... Assistant: ..." text: any tokenizer renders it


class ColourEnv(ProblemEnv):
    """One question whose answer must name a colour: reward 1 when it does (plus the format bonus)."""

    def __init__(self, renderer: renderers.Renderer, question: str) -> None:
        super().__init__(renderer, format_coef=0.1, require_stop_sequence_for_format=False)
        self.question = question

    def get_question(self) -> str:
        return self.question

    def check_answer(self, sample_str: str) -> bool:
        return any(c in sample_str.lower() for c in ("blue", "red", "green"))

    def check_format(self, sample_str: str) -> bool:
        return sample_str.strip() != ""

    def get_reference_answer(self) -> str:
        return "blue"


class ColourDataset(RLDataset):
    """`batches` batches of `groups` groups, each `group_size` copies of one question."""

    def __init__(self, model_name: str, batches: int, groups: int, group_size: int) -> None:
        self.renderer = renderers.get_renderer(RENDERER, get_tokenizer(model_name))
        self.batches, self.groups, self.group_size = batches, groups, group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        questions = [f"Name a colour of the sky (question {index}-{g})." for g in range(self.groups)]
        return [ProblemGroupBuilder(partial(ColourEnv, self.renderer, q), self.group_size, "colour")
                for q in questions]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class ColourDatasetBuilder(RLDatasetBuilder):
    model_name: str
    batches: int
    groups: int
    group_size: int

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return ColourDataset(self.model_name, self.batches, self.groups, self.group_size), None


def sl_config(url: str, model: str, log_path: str, args: dict[str, Any]) -> sl_train.Config:
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name=RENDERER,
                                            max_length=128, batch_size=args["batch_size"],
                                            train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    builder = FromConversationFileBuilder(common_config=common, file_path=args["data"], test_size=0)
    return sl_train.Config(log_path=log_path, model_name=model, recipe_name="carpool_compat_sl",
                           renderer_name=RENDERER, dataset_builder=builder, learning_rate=args["lr"],
                           lr_schedule="constant", num_epochs=args["epochs"], lora_rank=8, base_url=url,
                           save_every=args["save_every"], eval_every=0, infrequent_eval_every=0,
                           max_steps=args["max_steps"], ttl_seconds=None)


def rl_config(url: str, model: str, log_path: str, args: dict[str, Any]) -> rl_train.Config:
    builder = ColourDatasetBuilder(model_name=model, batches=args["batches"], groups=args["groups"],
                                   group_size=args["group_size"])
    return rl_train.Config(learning_rate=args["lr"], dataset_builder=builder, model_name=model,
                           recipe_name="carpool_compat_rl", max_tokens=args["max_tokens"], log_path=log_path,
                           eval_every=0, save_every=args["save_every"], renderer_name=RENDERER, lora_rank=8,
                           base_url=url, max_steps=args["max_steps"])


def main() -> None:
    mode, url, model, tokenizer_dir, log_path, raw = sys.argv[1:7]
    args = json.loads(raw)
    register_tokenizer(model, lambda: AutoTokenizer.from_pretrained(tokenizer_dir))
    if mode == "sl":
        asyncio.run(sl_train.main(sl_config(url, model, log_path, args)))
    else:
        asyncio.run(rl_train.main(rl_config(url, model, log_path, args)))


if __name__ == "__main__":
    main()
