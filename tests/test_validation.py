"""Every class of bad input gets a KVPassError (a TypeError/ValueError) naming the argument, before any work,
and leaves the user's model unchanged; failures inside generate leave no trace (issue 27)."""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path

import pytest
import torch
import transformers

import kvpass
from kvpass.errors import (
    InvalidType,
    InvalidValue,
    KVPassError,
    ModelInUse,
    OutOfDeviceMemory,
    UnsupportedModel,
)
from kvpass.validation import RULES, errors_markdown
from tests.conftest import padded_batch, tiny_model
from tests.policies.policy_helpers import apply_cached, captured_model

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _refused(call, error: type, argument: str):
    """Run ``call``: it must raise ``error`` (a KVPassError) whose message and .argument name ``argument``."""
    with pytest.raises(error) as info:
        call()
    err = info.value
    assert isinstance(err, KVPassError) and isinstance(err, (TypeError, ValueError, RuntimeError))
    assert err.argument is not None and argument in err.argument, (err.argument, argument)
    if not argument.startswith("(") and argument not in ("model", "policy_kwargs"):
        assert argument.split(".")[0] in str(err) or argument in str(err), str(err)
    return err


# ----------------------------------------------------------------------------------------------- the table
def test_docs_errors_md_is_the_table():
    got = (ROOT / "docs" / "errors.md").read_text()
    assert got == errors_markdown(), "docs/errors.md is stale: python -m kvpass.validation > docs/errors.md"


def test_every_rule_is_raised_somewhere():
    """Each rule key is refused in the code (descriptive rows point at the module that raises)."""
    source = "\n".join(p.read_text() for p in (ROOT / "kvpass").rglob("*.py") if p.name != "validation.py")
    source += (ROOT / "kvpass" / "validation.py").read_text().split("RULE: dict")[1]
    descriptive = {r.key for r in RULES if r.message.startswith("(")}
    for rule in RULES:
        if rule.key not in descriptive:
            assert f'"{rule.key}"' in source, rule.key
    assert {"model.attention", "policy.value", "export.value"} == descriptive
    assert all(issubclass(r.error, (TypeError, ValueError, RuntimeError)) for r in RULES)


# ----------------------------------------------------------------------------------------------- the model
def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64,
                                                                          num_layers=1, num_heads=2))


MODELS = {
    "not a module": (lambda: "gpt2", InvalidType),
    "no config": (lambda: torch.nn.Linear(4, 4), UnsupportedModel),
    "encoder-decoder": (_t5, UnsupportedModel),
    "encoder-only": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(**SMALL)), UnsupportedModel),
    "vision tower": (lambda: transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1,
                                                                           num_attention_heads=2,
                                                                           intermediate_size=64)), UnsupportedModel),
    "cross-attention": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=1, n_head=2, add_cross_attention=True)), UnsupportedModel),
    "alibi": (lambda: transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=128, hidden_size=32, n_layer=1,
                                                                              n_head=2)), UnsupportedModel),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_models_kvpass_cannot_rewrite(case):
    make, error = MODELS[case]
    model = make()
    before = _digest(model) if isinstance(model, torch.nn.Module) else None
    _refused(lambda: kvpass.apply(model, "d2o"), error, "model")
    if before is not None:
        assert _digest(model) == before


def test_meta_weights_and_spread_devices_and_rewritten():
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, num_key_value_heads=2))
    err = _refused(lambda: kvpass.apply(meta, "d2o"), UnsupportedModel, "model")
    assert "meta device" in str(err)
    model = tiny_model("llama")
    before = _digest(model)
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": "cpu"}
    try:
        err = _refused(lambda: kvpass.apply(model, "d2o"), UnsupportedModel, "model")
        assert "several devices" in str(err)
    finally:
        del model.hf_device_map
    kv = apply_cached("llama", "streamingllm", 0.5)
    _refused(lambda: kvpass.apply(kv, "d2o"), InvalidType, "model")
    assert _digest(model) == before


# ----------------------------------------------------------------------------------------------- policy, budget
@pytest.mark.parametrize("kwargs, error, argument", [
    (dict(policy=3), InvalidType, "policy"),
    (dict(policy="nope"), InvalidValue, "policy"),
    (dict(policy="d2o", sink=3), InvalidValue, "policy_kwargs"),
    (dict(policy="d2o", beta=2.0), InvalidValue, "policy_kwargs"),
    (dict(policy="d2o", sinks="4"), InvalidValue, "policy_kwargs"),
    (dict(policy="d2o", budget="0.2"), InvalidType, "budget"),
    (dict(policy="d2o", budget=1.5), InvalidValue, "budget"),
    (dict(policy="d2o", budget=0), InvalidValue, "budget"),
    (dict(policy="d2o", budget=300), InvalidValue, "budget"),           # context: 256 positions
    (dict(policy="streamingllm", budget=3, sinks=4), InvalidValue, "budget"),
    (dict(policy="d2o", fuse_linears="yes"), InvalidType, "fuse_linears"),
])
def test_policy_and_budget(kwargs, error, argument):
    model = tiny_model("llama")
    before = _digest(model)
    _refused(lambda: kvpass.apply(model, **kwargs), error, argument)
    assert _digest(model) == before


def test_compile_options():
    from kvpass.compile_backend import CompileOptions

    _refused(lambda: CompileOptions.parse(["d2o"]), InvalidType, "options")
    _refused(lambda: CompileOptions.parse({"polcy": "d2o"}), InvalidValue, "options")
    _refused(lambda: CompileOptions.parse({"mode": "fast"}), InvalidValue, "options")
    _refused(lambda: CompileOptions.parse({"budget": "1"}), InvalidValue, "options")


# ----------------------------------------------------------------------------------------------- inputs
def _kv():
    return apply_cached("llama", "d2o", 0.5)


IDS, MASK = padded_batch([10, 6])
INPUTS = {
    "float ids": (dict(input_ids=IDS.float()), InvalidType, "input_ids"),
    "bool ids": (dict(input_ids=IDS.bool()), InvalidType, "input_ids"),
    "3-D ids": (dict(input_ids=IDS[None]), InvalidValue, "input_ids"),
    "empty prompt": (dict(input_ids=IDS[:, :0]), InvalidValue, "input_ids"),
    "negative id": (dict(input_ids=IDS - 1), InvalidValue, "input_ids"),
    "id beyond vocab": (dict(input_ids=IDS + 128), InvalidValue, "input_ids"),
    "ids on another device": (dict(input_ids=IDS.to("meta")), InvalidValue, "input_ids"),
    "ids of another type": (dict(input_ids="hello"), InvalidType, "input_ids"),
    "mask shape": (dict(input_ids=IDS, attention_mask=MASK[:, 1:]), InvalidValue, "attention_mask"),
    "mask values": (dict(input_ids=IDS, attention_mask=MASK * 2), InvalidValue, "attention_mask"),
    "right padding": (dict(input_ids=IDS, attention_mask=MASK.flip(-1)), InvalidValue, "attention_mask"),
    "a hole": (dict(input_ids=IDS, attention_mask=torch.ones_like(MASK).index_fill(1, torch.tensor([3]), 0)),
               InvalidValue, "attention_mask"),
    "all-padding row": (dict(input_ids=IDS, attention_mask=MASK * torch.tensor([[1], [0]])), InvalidValue,
                        "attention_mask"),
    "max_new_tokens 0": (dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=0), InvalidValue, "max_new_tokens"),
    "max_new_tokens -3": (dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=-3), InvalidValue, "max_new_tokens"),
    "max_new_tokens str": (dict(input_ids=IDS, attention_mask=MASK, max_new_tokens="4"), InvalidType, "max_new_tokens"),
    "beyond the context": (dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=250), InvalidValue, "max_new_tokens"),
    "temperature 0": (dict(input_ids=IDS, do_sample=True, temperature=0.0), InvalidValue, "temperature"),
    "temperature < 0": (dict(input_ids=IDS, do_sample=True, temperature=-1.0), InvalidValue, "temperature"),
    "top_p 0": (dict(input_ids=IDS, do_sample=True, top_p=0.0), InvalidValue, "top_p"),
    "top_p 1.5": (dict(input_ids=IDS, do_sample=True, top_p=1.5), InvalidValue, "top_p"),
    "top_k -1": (dict(input_ids=IDS, do_sample=True, top_k=-1), InvalidValue, "top_k"),
    "beam search": (dict(input_ids=IDS, num_beams=4), InvalidType, "num_beams"),
    "assistant": (dict(input_ids=IDS, assistant_model=object()), InvalidType, "assistant_model"),
    "attentions": (dict(input_ids=IDS, output_attentions=True), InvalidType, "output_attentions"),
    "hidden states": (dict(input_ids=IDS, output_hidden_states=True), InvalidType, "output_hidden_states"),
    "constraints": (dict(input_ids=IDS, constraints=[object()]), InvalidType, "constraints"),
    "several sequences": (dict(input_ids=IDS, num_return_sequences=2), InvalidType, "num_return_sequences"),
    "contrastive": (dict(input_ids=IDS, penalty_alpha=0.6, top_k=4), InvalidType, "penalty_alpha"),
    "unknown": (dict(input_ids=IDS, frobnicate=1), InvalidType, "frobnicate"),
}


@pytest.mark.parametrize("case", list(INPUTS))
def test_bad_generate_input(case):
    kwargs, error, argument = INPUTS[case]
    kv = _kv()
    before = _digest(kv.model)
    _refused(lambda: kv.generate(**{"max_new_tokens": 3, **kwargs}), error, argument)
    assert _digest(kv.model) == before
    if "input_ids" in kwargs and case not in ("beyond the context",):
        _refused(lambda: kv(**{k: v for k, v in kwargs.items() if k in ("input_ids", "attention_mask")}),
                 error, argument) if argument in ("input_ids", "attention_mask") else None


def test_neutral_values_of_refused_features_are_accepted():
    kv = _kv()
    want = kv.generate(IDS[:1], max_new_tokens=3)
    got = kv.generate(IDS[:1], max_new_tokens=3, num_beams=1, output_attentions=False, num_return_sequences=1,
                      use_cache=True, assistant_model=None)
    assert torch.equal(got, want)


def test_cli_file_and_set():
    from kvpass.cli import parse_policy_args
    from kvpass.validation import check_readable_file

    _refused(lambda: check_readable_file("--prompt-file", "/no/such/file.txt"), InvalidValue, "--prompt-file")
    _refused(lambda: parse_policy_args(["sinks"]), InvalidValue, "--set")


# ----------------------------------------------------------------------------------------------- concurrency
def test_two_threads_on_one_model():
    """The second thread's generate gets ModelInUse while the first runs; the first gets its solo tokens."""
    kv = _kv()
    ids = IDS[:1]
    want = kv.generate(ids, max_new_tokens=6, eos_token_id=None)
    inside, release = threading.Event(), threading.Event()

    class Waiting:
        def put(self, value):
            inside.set()
            release.wait(timeout=30)

        def end(self):
            pass

    got = {}
    first = threading.Thread(target=lambda: got.setdefault("a", kv.generate(ids, max_new_tokens=6, eos_token_id=None,
                                                                           streamer=Waiting())))
    first.start()
    assert inside.wait(timeout=30)
    err = _refused(lambda: kv.generate(ids, max_new_tokens=6), ModelInUse, "(the model)")
    assert "in use" in str(err)
    release.set()
    first.join(timeout=60)
    assert torch.equal(got["a"], want)
    assert torch.equal(kv.generate(ids, max_new_tokens=6, eos_token_id=None), want)     # the lock was released


# ----------------------------------------------------------------------------------------------- resources
def test_memory_estimate_refuses_with_the_numbers():
    kv = apply_cached("llama", "d2o", 0.5)
    kv.free_bytes = lambda device: 1 << 20          # 1 MiB "free"
    try:
        err = _refused(lambda: kv.generate(torch.randint(1, 128, (64, 200)), max_new_tokens=4), OutOfDeviceMemory,
                       "input_ids")
        assert re.search(r"input_ids \(64 x 200 tokens\) needs about \d+ MiB .* 1 MiB are free", str(err))
        assert kv.generate(IDS[:1, :2], max_new_tokens=1).shape == (1, 3)   # small enough: runs
    finally:
        kv.free_bytes = None


# ----------------------------------------------------------------------------------------------- no trace
class _Boom(Exception):
    pass


def _fresh(policy: str, ids, new: int):
    model, _, _ = captured_model("llama")
    return kvpass.apply(model, policy, 0.3).generate(ids, max_new_tokens=new, eos_token_id=None)


@pytest.mark.parametrize("failure", ["oom in compression", "streamer raises", "keyboard interrupt"])
def test_failure_leaves_no_trace(failure, monkeypatch):
    kv = apply_cached("llama", "h2o", 0.3)
    ids = IDS[:1]
    before = _digest(kv.model)
    calls = {"n": 0}
    if failure == "oom in compression":
        def boom(self, cache, keep):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        with monkeypatch.context() as m:
            m.setattr(type(kv.policy), "compress_into", boom)
            err = _refused(lambda: kv.generate(ids, max_new_tokens=8, eos_token_id=None), OutOfDeviceMemory,
                           "input_ids")
            assert "session was freed" in str(err) and isinstance(err.__cause__, torch.OutOfMemoryError)
    else:
        class Bad:
            def put(self, value):
                calls["n"] += 1
                if calls["n"] == 4:               # the prompt, then three tokens: mid-decode
                    raise KeyboardInterrupt if failure == "keyboard interrupt" else _Boom("streamer")

            def end(self):
                pass

        with pytest.raises(KeyboardInterrupt if failure == "keyboard interrupt" else _Boom):
            kv.generate(ids, max_new_tokens=8, eos_token_id=None, streamer=Bad())
    assert _digest(kv.model) == before
    assert torch.equal(kv.generate(ids, max_new_tokens=8, eos_token_id=None), _fresh("h2o", ids, 8))
