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
    table = ROOT / "kvpass" / "validation" / "rules.py"
    source = "\n".join(p.read_text() for p in (ROOT / "kvpass").rglob("*.py") if p != table)
    source += table.read_text().split("RULE: dict")[1]
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


class _ToyAttentionLM(torch.nn.Module):
    """A one-layer 'causal LM' whose attention the rewrite cannot prove causal: ``bidirectional`` (SDPA without a
    mask, is_causal=False) or ``prefix`` (a prefix-LM mask: neither causal nor a sliding window)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.kind = kind
        self.config = PretrainedConfig(num_hidden_layers=1, max_position_embeddings=64, num_attention_heads=2,
                                       hidden_size=16)
        self.config.model_type = f"toy-{kind}"
        self.embed = torch.nn.Embedding(32, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        b, t = input_ids.shape
        q, k, v = (x.view(b, t, 2, 8).transpose(1, 2) for x in self.qkv(self.embed(input_ids)).chunk(3, -1))
        if self.kind == "bidirectional":
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False)
        else:
            i = torch.arange(t, device=input_ids.device)
            mask = (i[None, :] <= i[:, None]) | (i[None, :] < 4)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return type("Out", (), {"logits": self.head(o.transpose(1, 2).reshape(b, t, 16))})()


def _no_attention():
    from tests.runtime.test_bad_input import _NoAttentionLM

    return _NoAttentionLM()


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
    "no attention": (_no_attention, UnsupportedModel),
    "bidirectional attention": (lambda: _ToyAttentionLM("bidirectional"), UnsupportedModel),
    "prefix-LM mask": (lambda: _ToyAttentionLM("prefix"), UnsupportedModel),
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
    (dict(policy="d2o", compile="yes"), InvalidType, "compile"),
    (dict(policy="d2o", compile=1), InvalidType, "compile"),
    (dict(policy="d2o[beta=0.5"), InvalidValue, "policy"),                 # a spec that is not name[k=v,...]
    (dict(policy="d2o[bogus=1]"), InvalidValue, "policy_kwargs"),
    (dict(policy=kvpass.get_policy("d2o"), beta=0.5), InvalidType, "policy_kwargs"),
    (dict(policy="chelsea", calibration="/no/such/calibration.json"), InvalidValue, "calibration"),
    (dict(policy="chelsea", calibration=3), InvalidType, "calibration"),
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
    "several greedy sequences": (dict(input_ids=IDS, num_return_sequences=2), InvalidValue, "num_return_sequences"),
    "no sequences": (dict(input_ids=IDS, do_sample=True, num_return_sequences=0), InvalidValue,
                     "num_return_sequences"),
    "empty list": (dict(input_ids=[]), InvalidValue, "input_ids"),
    "eos str": (dict(input_ids=IDS, eos_token_id="x"), InvalidType, "eos_token_id"),
    "eos float": (dict(input_ids=IDS, eos_token_id=1.5), InvalidType, "eos_token_id"),
    "eos negative": (dict(input_ids=IDS, eos_token_id=[2, -1]), InvalidValue, "eos_token_id"),
    "pad str": (dict(input_ids=IDS, pad_token_id="x"), InvalidType, "pad_token_id"),
    "do_sample str": (dict(input_ids=IDS, do_sample="yes"), InvalidType, "do_sample"),
    "max_length str": (dict(input_ids=IDS, max_new_tokens=None, max_length="9"), InvalidType, "max_length"),
    "max_length within the prompt": (dict(input_ids=IDS, max_new_tokens=None, max_length=IDS.shape[1]), InvalidValue,
                                     "max_length"),
    "min_new_tokens -1": (dict(input_ids=IDS, min_new_tokens=-1), InvalidValue, "min_new_tokens"),
    "min_length float": (dict(input_ids=IDS, min_length=2.5), InvalidType, "min_length"),
    "repetition_penalty 0": (dict(input_ids=IDS, repetition_penalty=0.0), InvalidValue, "repetition_penalty"),
    "repetition_penalty str": (dict(input_ids=IDS, repetition_penalty="high"), InvalidType, "repetition_penalty"),
    "no_repeat_ngram_size -1": (dict(input_ids=IDS, no_repeat_ngram_size=-1), InvalidValue, "no_repeat_ngram_size"),
    "output_scores str": (dict(input_ids=IDS, output_scores="yes"), InvalidType, "output_scores"),
    "stopping_criteria int": (dict(input_ids=IDS, stopping_criteria=3), InvalidType, "stopping_criteria"),
    "logits_processor list of ints": (dict(input_ids=IDS, logits_processor=[1]), InvalidType, "logits_processor"),
    "generation_config str": (dict(input_ids=IDS, generation_config="greedy"), InvalidType, "generation_config"),
    "generation_config beams": (dict(input_ids=IDS, generation_config=transformers.GenerationConfig(num_beams=4)),
                                InvalidType, "generation_config.num_beams"),
    "generation_config bad words": (dict(input_ids=IDS, generation_config=transformers.GenerationConfig(
        bad_words_ids=[[5]])), InvalidType, "generation_config.bad_words_ids"),
    "typical_p": (dict(input_ids=IDS, typical_p=0.5), InvalidType, "typical_p"),
    "stop strings": (dict(input_ids=IDS, stop_strings=["."]), InvalidType, "stop_strings"),
    "generator": (dict(input_ids=IDS, do_sample=True, generator=7), InvalidType, "generator"),
    "streamer": (dict(input_ids=IDS, streamer=print), InvalidType, "streamer"),
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
    before = _digest(kv.model)
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
    assert _digest(kv.model) == before


# ----------------------------------------------------------------------------------------------- resources
def test_memory_estimate_refuses_with_the_numbers():
    kv = apply_cached("llama", "d2o", 0.5)
    before = _digest(kv.model)
    kv.free_bytes = lambda device: 1 << 20          # 1 MiB "free"
    try:
        err = _refused(lambda: kv.generate(torch.randint(1, 128, (64, 200)), max_new_tokens=4), OutOfDeviceMemory,
                       "input_ids")
        assert re.search(r"input_ids \(64 x 200 tokens\) needs about \d+ MiB .* 1 MiB are free", str(err))
        assert kv.generate(IDS[:1, :2], max_new_tokens=1).shape == (1, 3)   # small enough: runs
    finally:
        kv.free_bytes = None
    assert _digest(kv.model) == before


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


# ----------------------------------------------------------------------------------------------- more entry points
def test_budget_below_the_minimum_from_a_fraction_of_the_prompt():
    """A fraction that leaves fewer tokens than the policy's sinks + window for this prompt is refused at generate."""
    kv = apply_cached("llama", "streamingllm", 0.05, sinks=4)
    before = _digest(kv.model)
    err = _refused(lambda: kv.generate(IDS[:1], max_new_tokens=4), InvalidValue, "budget")
    assert "minimum" in str(err)
    assert _digest(kv.model) == before


def test_calibration_for_another_model():
    from tests.policies.test_chelsea_calibration import tiny_calibration

    model = tiny_model("llama")
    before = _digest(model)
    err = _refused(lambda: kvpass.apply(model, "chelsea", 0.2, calibration=tiny_calibration([(0, 0)], layers=3)),
                   InvalidValue, "calibration")
    assert "does not fit a model with 2 layers" in str(err)
    assert _digest(model) == before


def test_one_dimensional_ids_are_one_row():
    """input_ids [T] is accepted as the batch of one row [1, T] (not refused: unambiguous), same tokens."""
    kv = _kv()
    assert torch.equal(kv.generate(IDS[0], max_new_tokens=3), kv.generate(IDS[:1], max_new_tokens=3))


def test_compiled_module_and_its_options():
    """torch.compile(model, backend="kvpass", options=...): bad options are refused when the KVPassModel is built
    (the first call or ``generate``), naming ``options``; kvpass.compiled refuses anything else."""
    model = tiny_model("llama")
    before = _digest(model)
    for options in ({"polcy": "d2o"}, {"budget": 1.5}, {"budget": "a lot"}, {"mode": "fastest"}, ["d2o"]):
        compiled = torch.compile(model, backend="kvpass", options=options)
        _refused(lambda c=compiled: kvpass.compiled(c), (InvalidValue, InvalidType), "options")
    _refused(lambda: kvpass.compiled(model), InvalidType, "compiled")
    _refused(lambda: kvpass.compiled(torch.compile(model, backend="eager")), InvalidValue, "compiled")
    assert _digest(model) == before


def test_export_arguments(tmp_path):
    from kvpass.export import OnnxRunner, TensorRTUnavailable, tensorrt_available
    from kvpass.export import onnx as export_onnx
    from kvpass.export import tensorrt as export_tensorrt

    kv = apply_cached("llama", "streamingllm", 0.5)
    before = _digest(kv.model)
    _refused(lambda: export_onnx(kv.model, tmp_path), InvalidValue, "model")
    _refused(lambda: export_onnx(kv, tmp_path, max_length=1), InvalidValue, "max_length")
    _refused(lambda: export_onnx(kv, tmp_path, max_length=10**6), InvalidValue, "max_length")
    _refused(lambda: export_onnx(kv, tmp_path, max_length=64, tensorrt_check="maybe"), InvalidValue, "tensorrt_check")
    _refused(lambda: export_onnx(kv, tmp_path, max_length=64, example_length=64), InvalidValue, "example_length")
    _refused(lambda: export_onnx(kv, tmp_path, max_length=64, budget=1.5), InvalidValue, "budget")
    _refused(lambda: export_onnx(kv, tmp_path, max_length=64, budget=2), InvalidValue, "budget")   # < sinks + 1
    _refused(lambda: export_tensorrt(kv, tmp_path, precision="fp8"), InvalidValue, "precision")
    _refused(lambda: export_tensorrt(kv, tmp_path, max_batch=0), InvalidValue, "max_batch")
    if not tensorrt_available():
        with pytest.raises(TensorRTUnavailable):
            export_tensorrt(kv, tmp_path)
    assert not any(tmp_path.iterdir())                          # refused before writing anything
    _refused(lambda: OnnxRunner(tmp_path), InvalidValue, "out_dir")
    runner = OnnxRunner.__new__(OnnxRunner)                    # its input checks run before any session
    runner.meta = {"max_length": 64, "vocab_size": 128}
    for kwargs, error, argument in [(dict(input_ids=IDS.float()), InvalidType, "input_ids"),
                                    (dict(input_ids=IDS + 128), InvalidValue, "input_ids"),
                                    (dict(input_ids=IDS, attention_mask=MASK.flip(-1)), InvalidValue, "attention_mask"),
                                    (dict(input_ids=IDS, attention_mask=MASK[:, 1:]), InvalidValue, "attention_mask"),
                                    (dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=0), InvalidValue,
                                     "max_new_tokens"),
                                    (dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=60), InvalidValue,
                                     "max_new_tokens")]:
        _refused(lambda kw=kwargs: runner.generate(**kw), error, argument)
    assert _digest(kv.model) == before


# Every command's bad options: exit code 2, one line naming the option, and no model loaded (the loaders fail the
# test if called). (argv, what the message names)
CLI_CASES = {
    "generate --policy": (["generate", "--policy", "d2o[beta=0.5"], "policy spec"),
    "generate --set": (["generate", "--set", "sinks"], "--set"),
    "generate --set value": (["generate", "--policy", "streamingllm", "--set", "sinks=-1"], "sinks"),
    "generate --set calibration": (["generate", "--policy", "chelsea", "--set", "calibration=/no/such.json"],
                                   "calibration"),
    "generate --budget": (["generate", "--budget", "0"], "budget"),
    "generate --prompt-file": (["generate", "--prompt-file", "/no/such/prompt.txt"], "--prompt-file"),
    "generate --max-new-tokens": (["generate", "--max-new-tokens", "0"], "--max-new-tokens"),
    "generate --depth": (["generate", "--depth", "1.5"], "--depth"),
    "generate --context-tokens": (["generate", "--context-tokens", "0"], "--context-tokens"),
    "eval niah --policies": (["eval", "niah", "--policies", "nope"], "unknown policy 'nope'"),
    "eval niah --budgets": (["eval", "niah", "--budgets", "1.5"], "budget 1.5"),
    "eval niah --depths": (["eval", "niah", "--depths", "2"], "--depths"),
    "eval niah --jobs": (["eval", "niah", "--jobs", "0"], "--jobs"),
    "eval ppl --steps": (["eval", "ppl", "--steps", "0"], "--steps"),
    "eval fidelity --probes": (["eval", "fidelity", "--probes", "-1"], "--probes"),
    "eval leaderboard --policies": (["eval", "leaderboard", "--policies", "d2o[bogus=1]"], "bogus"),
    "eval suite run --policies": (["eval", "suite", "run", "--policies", "nope"], "unknown policy 'nope'"),
    "eval suite run --budgets": (["eval", "suite", "run", "--budgets", "0"], "budget 0"),
    "eval suite run --max-new-tokens": (["eval", "suite", "run", "--max-new-tokens", "essay_qa"], "--max-new-tokens"),
    "eval suite run --calibration": (["eval", "suite", "run", "--calibration", "/no/such.json"], "--calibration"),
    "eval suite calibrate --cases": (["eval", "suite", "calibrate", "--cases", "0"], "--cases"),
    "eval suite export --max-new-tokens": (["eval", "suite", "export", "--out", "x.jsonl", "--max-new-tokens",
                                            "single_needle=0"], "--max-new-tokens"),
    "calibrate --threshold": (["calibrate", "--threshold", "2"], "--threshold"),
    "calibrate --samples": (["calibrate", "--samples", "0"], "--samples"),
    "bench --budget": (["bench", "--budget", "2"], "budget 2.0"),
    "bench --sections": (["bench", "--sections", "kernels,nope"], "--sections"),
    "bench --methods": (["bench", "--methods", "d2o,nope"], "--methods"),
    "bench --prompts": (["bench", "--prompts", "16k"], "--prompts"),
    "bench --max-batch": (["bench", "--max-batch", "0"], "--max-batch"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_refuses_before_loading(case, monkeypatch, capsys, tmp_path):
    import benchmarks.bench.main
    import kvpass.eval.common
    import kvpass.models
    from kvpass.cli import main

    def loads(*args, **kwargs):
        raise AssertionError(f"{case}: a model was loaded (or the benchmark started) before the refusal")

    monkeypatch.setattr(kvpass.models, "load_model", loads)
    monkeypatch.setattr(kvpass.eval.common, "load", loads)
    monkeypatch.setattr(benchmarks.bench.main, "run", loads)       # what `kvpass bench` runs (benchmarks/speed.py)
    monkeypatch.chdir(tmp_path)
    argv, names = CLI_CASES[case]
    assert main([*argv, "--out-dir", str(tmp_path / "out")] if argv[0] == "eval" and argv[1] != "suite" else argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpass: error: ") and names in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_errors_coverage_cites_real_tests():
    """docs/errors-coverage.md (issue 27's checklist) cites only tests that exist: every `path::test` is a function
    of that file, every `[case]` after it (or after a previous citation on the line) a string in that file."""
    text = (ROOT / "docs" / "errors-coverage.md").read_text()
    cited = 0
    for line in text.split("\n- ["):
        current = None
        for path, name, case in re.findall(r"`(?:(tests/[\w/]+\.py)::(test_\w+))?(?:\[([^\]`]+)\])?`", line):
            if path:
                source = (ROOT / path).read_text()
                assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name}"
                current = source
                cited += 1
            if case:
                assert current is not None and case in current, (line[:60], case)
    assert cited >= 40
