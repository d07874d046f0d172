"""Where the known models' GGUF files come from: their PyPI package, or KVPASS_GGUF_<NAME>."""

from __future__ import annotations

import pytest

from kvpass.models import gguf_path


def test_environment_variable_points_at_the_gguf(tmp_path, monkeypatch):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("KVPASS_GGUF_GEMMA3_270M", str(f))
    assert gguf_path("gemma3-270m") == f


def test_environment_variable_to_a_missing_file_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPASS_GGUF_SMOLLM2", str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match="KVPASS_GGUF_SMOLLM2"):
        gguf_path("smollm2")


def test_unknown_name_is_refused_even_with_a_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPASS_GGUF_OTHER", str(tmp_path))
    with pytest.raises(ValueError, match="known"):
        gguf_path("other")
