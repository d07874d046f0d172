"""The pipeline (kvpass/rewrites/pipeline.py) is the one place graphs are built: every other module reaches
them through ``kvpass.apply`` or ``compile_model``, and a shared capture does not skip apply's checks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import kvpass
from kvpass.errors import InvalidType, InvalidValue
from kvpass.rewrites import capture_causal_lm, compile_model
from tests.policies.policy_helpers import captured_model

ROOT = Path(__file__).resolve().parents[2]
# The passes compile_model runs, and the model it feeds: called from nowhere but their own package (the
# pipeline) and kvpass/api.py; their unit tests (tests/rewrites/test_<pass>.py) call them on purpose.
PASSES = {"insert_compressed_cache", "build_prefill", "build_decode", "build_chunk_step", "fuse_sibling_linears",
          "linears_to_gemv", "shard_tensor_parallel"}
ALLOWED = {"KVPassModel": {"kvpass/api.py"}}


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_no_module_assembles_graphs_itself():
    files = [p for folder in ("kvpass", "benchmarks", "examples", "tests") for p in (ROOT / folder).rglob("*.py")]
    bad = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("kvpass/rewrites/", "tests/rewrites/test_")):
            continue
        for name in _calls(path) & (PASSES | set(ALLOWED)):
            if rel not in ALLOWED.get(name, set()):
                bad.append(f"{rel} calls {name}")
    assert not bad, "graphs built outside kvpass.rewrites.compile_model / kvpass.apply:\n" + "\n".join(sorted(bad))


def test_a_shared_capture_keeps_apply_s_checks():
    model, captured, _ = captured_model("llama")
    with pytest.raises(InvalidValue, match="minimum"):                     # below streamingllm's sinks + window
        kvpass.apply(model, "streamingllm", 2, captured=captured)
    with pytest.raises(InvalidType, match="capture_model"):
        kvpass.apply(model, "full", 1.0, captured=capture_causal_lm(model))
    with pytest.raises(InvalidValue, match="not a capture of this model"):
        kvpass.apply(captured_model("qwen2")[0], "full", 1.0, captured=captured)
    with pytest.raises(ValueError, match="capture_model"):
        compile_model(capture_causal_lm(model), kvpass.get_policy("full"))


def test_apply_on_a_shared_capture_equals_a_fresh_apply():
    model, captured, _ = captured_model("llama")
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    fresh = kvpass.apply(model, "h2o", 12).generate(ids, max_new_tokens=4, do_sample=False)
    shared = kvpass.apply(model, "h2o", 12, captured=captured).generate(ids, max_new_tokens=4, do_sample=False)
    assert fresh.tolist() == shared.tolist()
