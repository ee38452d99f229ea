"""Shared fixtures: tiny random-weight Qwen3 models built locally (no hub), offline settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen3 (hidden 64, vocab 512, GQA) with a locally trained tokenizer."""
    from worker.models.devmodel import build_dev_model

    return build_dev_model(tmp_path_factory.mktemp("tiny-qwen3"), layers=2, hidden=64, vocab=512, seed=0)
