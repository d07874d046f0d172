"""A tiny random Llama and a character-level stub tokenizer, so the harness runs in seconds."""

from __future__ import annotations

import pytest

from kvpass.eval.common import Loaded
from tests.conftest import tiny_model


class CharTokenizer:
    """One token per character (code point mod 128, so every id fits the tiny vocab); no chat template."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 128 for c in text]}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(int(i)) for i in ids)


@pytest.fixture(scope="session")
def tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture(scope="session")
def loaded(tokenizer) -> Loaded:
    return Loaded("tiny", tiny_model("llama"), tokenizer)
