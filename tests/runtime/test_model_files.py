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


def test_one_load_parses_the_gguf_once(monkeypatch):
    """transformers opens the file for the tokenizer and again for the config (and the weights): within
    ``one_gguf_parse`` the second opening is handed the first reader, and the reader is restored after."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from kvpass.models import one_gguf_parse

    try:
        path = gguf_path("smollm2")
    except FileNotFoundError as err:
        pytest.skip(str(err))
    parses = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            parses.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    with one_gguf_parse() as readers:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    assert len(parses) == 1 and len(readers) == 1
    assert gguf.GGUFReader is CountingReader
    assert config.num_hidden_layers == 30 and tokenizer.decode(tokenizer.encode("desert")).endswith("desert")
    AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    assert len(parses) == 2, "outside the context every opening parses"
