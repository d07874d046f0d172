"""The KVPassModel keeps transformers' model conventions (docs/transformers-compat.md): forward's output with
logits and loss, the base model's parameters and state dict from the start, .to() / .half() that never change the
model passed in, dtype / device / config, save_pretrained + kvpass.from_pretrained."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import kvpass
from kvpass.errors import KVPassError
from kvpass.runtime.hf_compat import KVPASS_CONFIG
from tests.conftest import padded_batch
from tests.conftest import tiny_model as _cached_model


def tiny_model(name: str) -> torch.nn.Module:
    """A copy of the session's tiny model (these tests convert models; the cached one is shared)."""
    return copy.deepcopy(_cached_model(name))


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == snapshot.keys() and all(
        now[k].dtype == v.dtype and now[k].device == v.device and torch.equal(now[k], v) for k, v in snapshot.items())


def test_forward_output_and_loss_match_transformers():
    model = tiny_model("llama")
    kv = kvpass.apply(model, policy="d2o", budget=10)
    ids, mask = padded_batch([21, 14])
    # -100 on the padding and on each row's first token, which the last pad position's logits would predict
    # (kvpass's logits at padding are not transformers'; docs/transformers-compat.md)
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 7] = -100
    got, want = kv(ids, attention_mask=mask, labels=labels), model(ids, attention_mask=mask, labels=labels)
    assert isinstance(got, transformers.modeling_outputs.CausalLMOutputWithPast)
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    assert kv(ids, attention_mask=mask).loss is None
    other = kv(ids, attention_mask=mask, labels=labels.roll(1, dims=1))
    assert (other.loss - got.loss).abs() > 1e-3                         # the loss reads the labels
    loss, logits = kv(ids, attention_mask=mask, labels=labels, return_dict=False)
    assert torch.equal(logits, got.logits) and torch.equal(loss, got.loss)
    assert kv(ids, attention_mask=mask, logits_to_keep=1).logits.shape == (2, 1, 128)
    assert kv(ids, use_cache=False, past_key_values=None).logits.shape == (2, 21, 128)


@pytest.mark.parametrize("kwargs, argument", [(dict(labels=torch.zeros(2, 5, dtype=torch.long)), "labels"),
                                              (dict(labels=torch.zeros(2, 21)), "labels"),
                                              (dict(inputs_embeds=torch.zeros(2, 21, 64)), "inputs_embeds"),
                                              (dict(output_hidden_states=True), "output_hidden_states"),
                                              (dict(logits_to_keep=-1), "logits_to_keep"),
                                              (dict(frobnicate=1), "frobnicate")])
def test_forward_refuses_what_it_does_not_take(kwargs, argument):
    kv = kvpass.apply(tiny_model("llama"), policy="full")
    ids, _ = padded_batch([21, 14])
    with pytest.raises(KVPassError) as info:
        kv(ids, **kwargs)
    assert info.value.argument == argument


def test_parameters_and_state_dict_are_the_models_from_the_start():
    model = tiny_model("llama")
    kv = kvpass.apply(model, policy="d2o", budget=10)
    keys = list(model.state_dict())
    assert list(kv.state_dict()) == keys
    assert [id(p) for p in kv.parameters()] == [id(p) for p in model.parameters()]
    ids, _ = padded_batch([21])
    kv(ids)
    kv.generate(ids, max_new_tokens=4)
    assert list(kv.state_dict()) == keys                                 # no graph module joined the tree
    assert [n for n, _ in kv.named_modules()] == [""]
    assert kv.dtype == torch.float32 and kv.device == torch.device("cpu") and kv.config is model.config
    assert kv.generation_config is model.generation_config and kv.can_generate()
    assert kv.num_parameters() == model.num_parameters()


@pytest.mark.parametrize("before_forward", [True, False])
def test_to_bfloat16_rebuilds_and_leaves_the_model_untouched(before_forward):
    model = tiny_model("llama")
    snapshot = _snapshot(model)
    kv = kvpass.apply(model, policy="d2o", budget=10)
    kv.prefill_rows = 1
    ids, _ = padded_batch([21])
    if not before_forward:
        kv(ids)
        kv.generate(ids, max_new_tokens=4)
    graphs = kv.graphs
    assert kv.to(torch.bfloat16) is kv
    assert kv.dtype == torch.bfloat16 and kv.graphs is not graphs and kv.prefill_rows == 1
    assert _unchanged(model, snapshot)                                   # the README's promise
    assert kv(ids).logits.dtype == torch.bfloat16
    got = kv.generate(ids, max_new_tokens=12)
    want = kvpass.apply(tiny_model("llama").to(torch.bfloat16), policy="d2o", budget=10).generate(ids, max_new_tokens=12)
    assert torch.equal(got, want)
    assert kv.float() is kv and kv.dtype == torch.float32
    assert torch.equal(kv.generate(ids, max_new_tokens=12),
                       kvpass.apply(model, policy="d2o", budget=10).generate(ids, max_new_tokens=12))
    assert _unchanged(model, snapshot)


def test_to_the_same_dtype_and_device_changes_nothing():
    model = tiny_model("llama")
    kv = kvpass.apply(model, policy="full")
    graphs = kv.graphs
    assert kv.to(torch.float32) is kv and kv.to("cpu") is kv and kv.cpu() is kv and kv.eval() is kv
    assert kv.graphs is graphs and kv.model is model


def test_half_keeps_tied_weights_tied():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    kv = kvpass.apply(model, policy="full").half()
    assert kv.model.lm_head.weight is kv.model.model.embed_tokens.weight
    assert kv.dtype == torch.float16 and model.dtype == torch.float32


def test_load_state_dict_writes_the_shared_weights():
    model = tiny_model("llama")
    kv = kvpass.apply(model, policy="full")
    ids, _ = padded_batch([21])
    before = kv(ids).logits
    state = {k: v * 0.5 for k, v in model.state_dict().items()}
    kv.load_state_dict(state)
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert not torch.allclose(kv(ids).logits, before)
    with pytest.raises(KVPassError, match="assign"):
        kv.load_state_dict(state, assign=True)


def test_save_pretrained_and_from_pretrained_round_trip(tmp_path):
    model = tiny_model("llama")
    kv = kvpass.apply(model, policy="d2o", budget=12, interval=4, prefill_chunk=8)
    ids, _ = padded_batch([21])
    want = kv.generate(ids, max_new_tokens=12)
    kv.save_pretrained(tmp_path)
    assert (tmp_path / KVPASS_CONFIG).is_file() and (tmp_path / "config.json").is_file()
    loaded = kvpass.from_pretrained(tmp_path)
    assert loaded.policy == kv.policy and loaded.budget == 12 and loaded.prefill_chunk == 8
    assert torch.equal(loaded.generate(ids, max_new_tokens=12), want)
    other = kvpass.KVPassModel.from_pretrained(tmp_path, policy="streamingllm", budget=0.5)
    assert other.policy.name == "streamingllm" and other.budget == 0.5


def test_save_and_load_refusals(tmp_path):
    from tests.export.test_onnx_export import AlternatingSinks

    kv = kvpass.apply(tiny_model("llama"), policy=AlternatingSinks(sinks=2, interval=4), budget=10)
    with pytest.raises(KVPassError, match="registered"):
        kv.save_pretrained(tmp_path / "a")
    assert not (tmp_path / "a").exists()                                # refused before writing
    with pytest.raises(KVPassError, match=KVPASS_CONFIG) as info:
        kvpass.from_pretrained(tmp_path)
    assert info.value.argument == "path"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_transformers_script_runs_unchanged(dtype):
    """The script people port: forward with labels, .to(dtype), generate with max_length, a generation_config,
    stopping criteria and output_scores. On the kvpass model with ``full`` it runs unchanged and the transformers
    model stays as it was; in float64 it gives the transformers model's tokens (in bfloat16 the two round
    differently: ``full`` is token-equal in float32 and above)."""

    def script(model, ids):
        loss = model(ids, labels=ids).loss.detach()
        model = model.to(dtype)
        out = model.generate(ids, max_length=30, generation_config=transformers.GenerationConfig(
            repetition_penalty=1.2, do_sample=False), stopping_criteria=transformers.StoppingCriteriaList(
            [transformers.MaxLengthCriteria(max_length=28)]), output_scores=True, return_dict_in_generate=True)
        return float(loss), out.sequences, out.scores, model.dtype

    ids, _ = padded_batch([21])
    base = tiny_model("llama")
    snapshot = _snapshot(base)
    got = script(kvpass.apply(base, policy="full"), ids)
    assert _unchanged(base, snapshot)
    want = script(tiny_model("llama"), ids)
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    assert got[1].shape == want[1].shape == (1, 28) and len(got[2]) == len(want[2]) == 7
    assert got[3] == want[3] == dtype
    if dtype == torch.float64:
        assert torch.equal(got[1], want[1])


def test_fused_linears_save_and_convert(tmp_path):
    """With fuse_linears (the CUDA default) the parameters are views of concatenated weights: save_pretrained
    writes them as plain tensors, the reloaded model fuses again, and .half() rebuilds fused."""
    model = tiny_model("llama")
    snapshot = _snapshot(model)
    kv = kvpass.apply(model, policy="full", fuse_linears=True)
    assert kv.fused_linears
    ids, _ = padded_batch([10])
    want = kv.generate(ids, max_new_tokens=8)
    kv.save_pretrained(tmp_path)
    loaded = kvpass.from_pretrained(tmp_path)
    assert loaded.fused_linears and torch.equal(loaded.generate(ids, max_new_tokens=8), want)
    kv.half()
    assert kv.fused_linears and kv.dtype == torch.float16 and _unchanged(model, snapshot)
