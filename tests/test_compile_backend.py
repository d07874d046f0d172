"""The torch.compile backend "kvpass": same greedy tokens as kvpass.apply (through kvpass.compiled and
through the compiled module's own generate), no graph breaks in a decode step, one compile of the decode
graph over 50 steps, options validated, other backends' generate left as torch gives it."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch._dynamo.eval_frame import OptimizedModule

import kvpass
from kvpass.compile_backend import (
    COMPILE_COUNTS,
    CompileOptions,
    GenerateHook,
    register,
    unregister_generate,
)

OPTIONS = {"policy": "streamingllm", "budget": 10, "policy_kwargs": {"sinks": 2, "interval": 4}}
D2O_OPTIONS = {"policy": "d2o", "budget": 12, "policy_kwargs": {"sinks": 2, "interval": 4}}


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def compiled(llama):
    torch._dynamo.reset()
    return kvpass.compiled(torch.compile(llama, backend="kvpass", options=OPTIONS))


def test_backend_is_registered():
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "kvpass" in list_backends(exclude_tags=())
    assert lookup_backend("kvpass").__name__ == "kvpass_backend"


def test_compiled_generate_equals_apply_without_recompiling(llama, compiled):
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    eager = kvpass.apply(llama, policy="streamingllm", budget=10, sinks=2, interval=4)
    want = eager.generate(ids, max_new_tokens=51, eos_token_id=[])
    COMPILE_COUNTS.clear()
    got = compiled.generate(ids, max_new_tokens=51, eos_token_id=[])      # 50 decode steps
    assert torch.equal(got, want)
    assert compiled.last_report.compressions > 5                          # the loop compressed repeatedly
    assert COMPILE_COUNTS["decode"] == 1 and COMPILE_COUNTS["prefill"] == 1
    again = compiled.generate(ids, max_new_tokens=51, eos_token_id=[])    # same shapes: nothing recompiles
    assert torch.equal(again, want) and COMPILE_COUNTS["decode"] == 1


@pytest.mark.parametrize("options", [OPTIONS, D2O_OPTIONS], ids=["streamingllm", "d2o"])
def test_torch_compile_result_generates_with_kvpass(llama, options):
    """``torch.compile(model, backend="kvpass", ...).generate``, no kvpass.compiled call: kvpass.apply's
    greedy tokens, a compressed cache, the compiled decode graph, and nothing recompiled on a second call."""
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    eager = kvpass.apply(llama, policy=options["policy"], budget=options["budget"], **options["policy_kwargs"])
    want = eager.generate(ids, max_new_tokens=51, eos_token_id=[])
    torch._dynamo.reset()
    compiled = torch.compile(llama, backend="kvpass", options=options)
    COMPILE_COUNTS.clear()
    got = compiled.generate(ids, max_new_tokens=51, eos_token_id=[])      # 50 decode steps
    model = kvpass.compiled(compiled)                                     # the one behind compiled.generate
    assert compiled.generate.__self__ is model
    assert torch.equal(got, want)
    report = model.last_report
    assert report.compressions > 5 and report.cache_bytes < report.full_cache_bytes
    assert COMPILE_COUNTS["decode"] == 1 and COMPILE_COUNTS["prefill"] == 1
    again = compiled.generate(ids, max_new_tokens=51, eos_token_id=[])    # 50 more steps, same shapes
    assert torch.equal(again, want)
    assert COMPILE_COUNTS["decode"] == 1 and COMPILE_COUNTS["prefill"] == 1


def test_generate_hook_leaves_other_backends_alone(llama):
    assert isinstance(vars(OptimizedModule)["generate"], GenerateHook)
    for other in (torch.compile(llama, backend="eager"), torch.compile(llama)):    # "eager", default inductor
        assert other.generate.__func__ is type(llama).generate and other.generate.__self__ is llama
    for backend, options in (("eager", None), ("kvpass", OPTIONS)):              # no generate to forward
        linear = torch.compile(torch.nn.Linear(2, 2), backend=backend, options=options)
        assert not hasattr(linear, "generate")
        with pytest.raises(AttributeError, match="generate"):
            linear.generate  # noqa: B018

    eager = torch.compile(llama, backend="eager")
    def patched(*args, **kwargs):
        return None
    eager.generate = patched                       # setting and deleting reach the eager model, as in torch
    try:
        assert llama.generate is patched and eager.generate is patched
    finally:
        del eager.generate
    assert "generate" not in vars(llama) and eager.generate.__self__ is llama


def test_generate_hook_is_idempotent_and_removable(llama):
    hook = vars(OptimizedModule)["generate"]
    register()
    assert vars(OptimizedModule)["generate"] is hook
    unregister_generate()
    try:
        assert "generate" not in vars(OptimizedModule)
        compiled = torch.compile(llama, backend="kvpass", options=OPTIONS)
        assert compiled.generate.__self__ is llama              # torch's own forwarding again
    finally:
        register()
    assert isinstance(vars(OptimizedModule)["generate"], GenerateHook)


def test_decode_step_has_no_graph_breaks(compiled):
    """Record one decode step's real inputs, then ask Dynamo to explain the decode graph on them."""
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    original, decode, seen = compiled.compiled_decode, compiled.eager_graphs.decode, []

    def record(*args):
        seen.append([a.clone() for a in args])
        return decode(*args)

    compiled.compiled_decode = record
    try:
        compiled.generate(ids, max_new_tokens=3, eos_token_id=[])
    finally:
        compiled.compiled_decode = original
    explanation = torch._dynamo.explain(decode)(*seen[0])
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


@pytest.mark.parametrize("options, match", [
    ({"policy": "nope"}, "unknown policy"),
    ({"budget": 1.5}, "fraction"),
    ({"budget": "a lot"}, "budget"),
    ({"policy": "streamingllm", "policy_kwargs": {"sinkz": 1}}, "no parameter"),
    ({"mode": "fastest"}, "mode"),
    ({"bugdet": 0.2}, r"unknown kvpass compile option\(s\) bugdet"),
])
def test_bad_options_raise_value_error(options, match):
    with pytest.raises(ValueError, match=match):
        CompileOptions.parse(options)


def test_backend_validates_options_when_compiling():
    fn = torch.compile(lambda x: x + 1, backend="kvpass", options={"budget": 0})
    with pytest.raises(Exception, match="budget 0"):
        fn(torch.ones(2))


def test_compiled_rejects_other_backends(llama):
    with pytest.raises(ValueError, match="backend 'eager'"):
        kvpass.compiled(torch.compile(llama, backend="eager"))
    with pytest.raises(TypeError, match="torch.compile"):              # kvpass.errors.InvalidType
        kvpass.compiled(llama)


def test_compiled_d2o_equals_apply_on_uneven_allocations(llama):
    """The compile path resolves budgets as kvpass.apply does (it runs the same runtime): D2O's per-layer budgets
    from each prompt and a fraction of each prompt + new tokens, on prompts whose allocation is uneven."""
    options = {"policy": "d2o", "budget": 0.3, "policy_kwargs": {"interval": 4}}
    eager = kvpass.apply(llama, policy="d2o", budget=0.3, interval=4)
    prompts = []
    for length, seed in ((12, 0), (16, 1), (23, 2), (30, 1), (41, 0), (40, 3)):
        ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(seed))
        eager.generate(ids, max_new_tokens=1)
        if len(set(eager.last_report.layer_budgets.values())) > 1:
            prompts.append(ids)
    assert len(prompts) >= 2
    torch._dynamo.reset()
    compiled = torch.compile(llama, backend="kvpass", options=options)
    for ids in prompts[:2]:
        want = eager.generate(ids, max_new_tokens=20)
        budgets = eager.last_report.layer_budgets
        assert torch.equal(compiled.generate(ids, max_new_tokens=20), want)
        assert kvpass.compiled(compiled).last_report.layer_budgets == budgets
