"""The table of every refusal (``RULES``), ``refuse``, and the checks of the model, policy and budget; the other
checks are in the sibling modules of ``kvpass.validation`` (its docstring).

``RULES`` is the table of every refusal: a key, the entry points that check it, the argument, the condition
and the message (a template filled with the values). ``refuse(key, **values)`` raises the rule's error
(``kvpass.errors``: ``InvalidValue`` is a ValueError, ``InvalidType`` a TypeError, both ``KVPassError``s) with
``.argument`` set; docs/errors.md is generated from the table (``errors_markdown``), and a test checks that the
file is what the table gives, so the two cannot drift. The checks here and in the sibling modules are the only places
that refuse user input; ``kvpass.apply``, ``KVPassModel.generate``/``__call__``/``start``, the compile backend's options,
``kvpass.export.*`` and the CLI call them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from kvpass.errors import (
    InvalidType,
    InvalidValue,
    KVPassError,
    ModelInUse,
    OutOfDeviceMemory,
    UnsupportedModel,
)

APPLY = "kvpass.apply, torch.compile(backend='kvpass'), CLI"
GENERATE = "KVPassModel.generate / __call__ / start / prefill, OnnxRunner.generate, CLI generate"
MODEL = "KVPassModel (forward / __call__, .to / .half / .cuda, save_pretrained, kvpass.from_pretrained)"
CALIBRATION = "Chelsea(calibration=...), kvpass.apply(..., calibration=...), CLI --set calibration=..."


@dataclass(frozen=True)
class Rule:
    """One refusal: ``message`` is formatted with the values ``refuse`` gets."""

    key: str
    entry: str
    argument: str
    condition: str
    message: str
    error: type[KVPassError] = InvalidValue


RULES: tuple[Rule, ...] = (
    # ------------------------------------------------------------------ the model
    Rule("model.type", APPLY, "model", "not a torch.nn.Module",
         "model must be a torch.nn.Module (a transformers *ForCausalLM), got {got}", InvalidType),
    Rule("model.rewritten", APPLY, "model", "already a KVPassModel (kvpass.apply ran on it)",
         "model is already rewritten by kvpass ({got}); pass the original transformers model "
         "(KVPassModel.model)", InvalidType),
    Rule("model.config", APPLY, "model", "no transformers config (model.config)",
         "model {got} has no transformers config (model.config); kvpass rewrites transformers causal LMs",
         UnsupportedModel),
    Rule("model.encoder_decoder", APPLY, "model", "config.is_encoder_decoder (T5, BART, Whisper...)",
         "model {got} is an encoder-decoder; kvpass rewrites decoder-only causal LMs (*ForCausalLM)",
         UnsupportedModel),
    Rule("model.not_causal_lm", APPLY, "model",
         "a transformers model that is not a causal LM: encoder-only (BERT), a vision tower (ViT), a base model "
         "without an LM head (other modules go on to the attention search)",
         "model {got} is not a causal language model; kvpass needs a decoder with an LM head "
         "(a *ForCausalLM / *LMHeadModel class)", UnsupportedModel),
    Rule("model.cross_attention", APPLY, "model", "config.add_cross_attention (a decoder attending to an encoder)",
         "model {got} has cross-attention (config.add_cross_attention); kvpass can only prove causal "
         "self-attention", UnsupportedModel),
    Rule("model.score_bias", APPLY, "model", "attention score biases (ALiBi: config.alibi, bloom, mpt)",
         "model {got} adds a position bias to the attention scores ({bias}); kvpass cannot prove the "
         "rewritten attention equal, so it refuses it", UnsupportedModel),
    Rule("model.meta", APPLY, "model", "weights on the meta device (not loaded)",
         "model {got} has weights on the meta device ({names}); load the weights (no device_map='meta' / "
         "init_empty_weights) before kvpass.apply", UnsupportedModel),
    Rule("model.spread", APPLY, "model", "weights spread over several devices (device_map)",
         "model {got} has weights on several devices ({devices}); kvpass runs a model on one device: "
         "load it with device_map=None and .to(device)", UnsupportedModel),
    Rule("model.attention", APPLY, "model", "no attention found, or attention in a form the rewrite cannot prove "
         "(kvpass/rewrites/attention_sites.py)", "(the message names the layer and what was found)",
         UnsupportedModel),
    # ------------------------------------------------------------------ the policy and budget
    Rule("policy.type", APPLY, "policy", "neither a policy name (str) nor a Policy instance",
         "policy must be a policy name ({names}) or a kvpass Policy, got {got}", InvalidType),
    Rule("policy.unknown", APPLY, "policy", "a name that is not registered",
         "unknown policy {got!r}; available: {names}"),
    Rule("policy.spec", f"{APPLY}, evaluations (--policies)", "policy", "a spec that is not name or name[key=value,...]",
         "policy spec {got!r}: write a name, or name[key=value,...] such as d2o[scores=window]"),
    Rule("policy.kwargs_with_instance", APPLY, "policy_kwargs", "keyword arguments with a Policy instance",
         "policy keyword arguments ({names}) go with a policy name, not a Policy instance", InvalidType),
    Rule("policy.parameter", APPLY, "policy_kwargs", "a parameter the policy does not have",
         "policy {policy!r} has no parameter(s) {got}; its parameters: {names}{hint}"),
    Rule("policy.value", APPLY, "policy_kwargs", "a parameter of the wrong type or out of range (each policy's "
         "__post_init__)", "(the policy's message, e.g. 'd2o: beta must lie in [0, 1], got 2')"),
    Rule("kvzip.surrogate", APPLY, "policy_kwargs", "kvzip[scores=predicted] with a surrogate that is neither a "
         "file nor a shipped name", "no KVzip surrogate {got!r}: give a file written by `kvpass calibrate kvzip` or "
         "a shipped name ({names})"),
    Rule("kvzip.surrogate_model", APPLY, "policy_kwargs", "kvzip[scores=predicted] for a model no surrogate was "
         "fitted on", "the KVzip surrogate ({got}) does not fit this model ({model}); fit one: kvpass calibrate kvzip "
         "--model MODEL --out FILE, then kvzip[scores=predicted,surrogate=FILE]"),
    Rule("context.type", GENERATE, "context", "not a ContextCache (KVPassModel.compress_context)",
         "context must be what model.compress_context(context_ids) returned, got {got}", InvalidType),
    Rule("context.model", GENERATE, "context", "a context cache another KVPassModel made",
         "this context cache was compressed by another KVPassModel (another policy, budget or model); compress it "
         "with this one: model.compress_context(context_ids)"),
    Rule("context.rows", GENERATE, "context", "questions whose rows neither are one per context row nor share "
         "a one-row context", "{got} question rows for a context cache of {rows} rows: give one question row per "
         "context row, or compress a single context (one row) that every question shares"),
    Rule("context.full_heads", GENERATE, "context", "a policy with KV heads kept full (Chelsea's calibrated "
         "outlier heads)", "questions over a compressed context are not supported with full-cache KV heads "
         "(a calibration's outlier heads)"),
    Rule("budget.type", APPLY, "budget", "not a float or an int (bool, str, None)",
         "budget must be a float fraction in (0, 1] or an int token count, got {got!r}", InvalidType),
    Rule("budget.fraction", APPLY, "budget", "a float outside (0, 1]",
         "budget {got} is a fraction and must lie in (0, 1]; pass an int for a token count"),
    Rule("budget.tokens", APPLY, "budget", "an int < 1", "budget {got} is a token count and must be >= 1"),
    Rule("budget.context", APPLY, "budget", "an int above the model's context",
         "budget {got} tokens exceeds the model's context of {context} tokens; at most {context} (or a fraction)"),
    Rule("budget.minimum", APPLY + "; " + GENERATE, "budget",
         "fewer tokens than the policy's minimum (sinks + window), given or from a fraction of a prompt",
         "budget of {got} tokens{source} is smaller than {policy}'s minimum of {minimum} (sinks + window)"),
    Rule("fuse_linears.type", APPLY, "fuse_linears", "not True, False or None",
         "fuse_linears must be True, False or None (on CUDA only), got {got!r}", InvalidType),
    Rule("compile.type", APPLY, "compile", "not True, False or None",
         "compile must be True, False or None (compiled on CUDA, eager elsewhere), got {got!r}", InvalidType),
    Rule("kv_dtype.value", APPLY, "kv_dtype", "not None, 'int8' or 'fp8_e4m3'",
         "kv_dtype must be None (the model's dtype), 'int8' or 'fp8_e4m3', got {got!r}"),
    Rule("kv_dtype.device", APPLY, "kv_dtype", "'fp8_e4m3' on a CUDA GPU of compute capability below 8.9 (its Triton "
         "has no e4m3 conversions)", "kv_dtype='fp8_e4m3' needs a CUDA GPU of compute capability 8.9 or later (Ada, "
         "Hopper, Blackwell): {got}; use kv_dtype='int8'", UnsupportedModel),
    Rule("kv_dtype.unsupported", APPLY + "; " + GENERATE + "; kvpass.export.*", "kv_dtype",
         "a quantized cache with tensor parallelism (tp > 1), a compressed context (generate(context=...), "
         "compress_context) or an export",
         "kv_dtype={got!r} is not supported with {what} yet; {advice}"),
    Rule("tp.value", APPLY, "tp", "not an int >= 1 (or None); a device_mesh not 1-D, or of another size than tp",
         "{name} must be {allowed}, got {got!r}"),
    Rule("tp.processes", APPLY, "tp", "tp > 1 without one process per shard (torchrun), or another number of "
         "processes than tp",
         "tp={got} needs exactly {got} processes, one per shard ({found}): start it with "
         "`torchrun --nproc-per-node {got} ...` (or initialise torch.distributed and pass device_mesh=)"),
    Rule("prefill_chunk.type", APPLY + "; " + GENERATE, "prefill_chunk", "not an int or None",
         "prefill_chunk must be an int number of prompt tokens per chunk, or None (prefill in one piece), got {got!r}",
         InvalidType),
    Rule("prefill_chunk.range", APPLY + "; " + GENERATE, "prefill_chunk", "an int < 1",
         "prefill_chunk must be >= 1 token, got {got}"),
    Rule("prefill_chunk.policy", APPLY + "; " + GENERATE, "prefill_chunk",
         "a policy that cannot compress between chunks (EMS), full-cache KV heads (a calibration's outlier heads)",
         "prefill_chunk={got} cannot be used with {reason}; prefill in one piece "
         "(prefill_chunk=None)"),
    Rule("captured.type", "kvpass.apply", "captured", "not a matched capture (kvpass.rewrites.capture_model)",
         "captured must be kvpass.rewrites.capture_model(model), a capture with its attention sites, got {got}",
         InvalidType),
    Rule("model.sharded", "kvpass.apply", "model",
         "its parameters are already a rank's tensor-parallel shards (an earlier kvpass.apply(..., tp=N) sharded "
         "them in place), and no capture sharded for that rank is given",
         "model's parameters are already rank {rank}'s shards for tp={world} (an earlier kvpass.apply(..., tp=...) "
         "sharded them in place), so it cannot be rewritten {what}; build the model anew for this call, or pass "
         "captured=<that KVPassModel>.captured with tp={world} to apply another policy to it", UnsupportedModel),
    Rule("captured.model", "kvpass.apply", "captured",
         "a capture of another model type, or sharded for another tensor-parallel world",
         "captured ({got}) is not a capture of this model ({model}) for tp={tp}; capture it with "
         "kvpass.rewrites.capture_model(model[, shard])"),
    Rule("options.type", "torch.compile(backend='kvpass', options=...)", "options", "not a dict",
         "options must be a dict like {{'policy': 'd2o', 'budget': 0.2}}, got {got!r}", InvalidType),
    Rule("options.key", "torch.compile(backend='kvpass', options=...)", "options", "an unknown key",
         "unknown kvpass compile option(s) {got} in options; allowed: {names}"),
    Rule("options.value", "torch.compile(backend='kvpass', options=...)", "options",
         "policy not a name, policy_kwargs not a dict, a bad budget, mode not an Inductor mode",
         "options[{name!r}] must be {allowed}, got {got!r}"),
    Rule("compiled.type", "kvpass.compiled", "compiled", "not the result of torch.compile",
         "compiled must be the result of torch.compile(model, backend='kvpass'), got {got}", InvalidType),
    Rule("compiled.backend", "kvpass.compiled", "compiled", "compiled with another backend",
         "compiled: this module was compiled with backend {got!r}; use torch.compile(model, backend='kvpass')"),
    # ------------------------------------------------------------------ the inputs
    Rule("input_ids.missing", GENERATE, "input_ids", "None", "generate() needs input_ids"),
    Rule("input_ids.type", GENERATE, "input_ids", "not a tensor or a list of ints",
         "input_ids must be a LongTensor [batch, tokens] (or a list of ints), got {got}", InvalidType),
    Rule("input_ids.dtype", GENERATE, "input_ids", "a float or bool tensor",
         "input_ids must hold integer token ids, got dtype {got}; use .long()", InvalidType),
    Rule("input_ids.shape", GENERATE, "input_ids", "not 1-D or 2-D, or no tokens",
         "input_ids must be [batch, tokens] (or [tokens]) with at least one token, got shape {got}"),
    Rule("input_ids.device", GENERATE, "input_ids", "a tensor on another device than the model",
         "input_ids is on {got}, the model on {device}; move it with .to({device!r})"),
    Rule("input_ids.range", GENERATE, "input_ids", "an id < 0 or >= the vocabulary size",
         "input_ids holds token id {got} (row {row}), outside the vocabulary [0, {vocab})"),
    Rule("input_ids.context", GENERATE, "input_ids", "a prompt longer than the model's context",
         "prompt of {got} tokens is longer than the model's context of {context} tokens"),
    Rule("max_new_tokens.context", GENERATE, "max_new_tokens", "prompt + max_new_tokens beyond the context",
         "prompt of {prompt} tokens + max_new_tokens={got} exceeds the model's context of {context} tokens"),
    Rule("attention_mask.type", GENERATE, "attention_mask", "not a tensor or list",
         "attention_mask must be a tensor [batch, tokens] of 0/1, got {got}", InvalidType),
    Rule("attention_mask.shape", GENERATE, "attention_mask", "another shape than input_ids",
         "attention_mask shape {got} differs from input_ids {want}"),
    Rule("attention_mask.values", GENERATE, "attention_mask", "values other than 0 and 1",
         "attention_mask must hold only 0 and 1, got {got}"),
    Rule("attention_mask.padding", GENERATE, "attention_mask", "right padding or holes (a row not 0...0 1...1)",
         "kvpass needs left padding (each attention_mask row 0...0 1...1), row {row} is not; "
         "set tokenizer.padding_side = 'left'"),
    Rule("attention_mask.empty_row", GENERATE, "attention_mask", "a row of only padding",
         "row {row} of attention_mask has no tokens (all padding)"),
    # ------------------------------------------------------------------ generation settings
    Rule("max_new_tokens.type", GENERATE, "max_new_tokens", "not an int", "max_new_tokens must be an int, got {got!r}",
         InvalidType),
    Rule("max_new_tokens.range", GENERATE, "max_new_tokens", "<= 0", "max_new_tokens must be >= 1, got {got}"),
    Rule("temperature.range", GENERATE, "temperature", "<= 0 (or not finite) with do_sample=True",
         "temperature must be > 0 when sampling (do_sample=True), got {got}; use do_sample=False for greedy"),
    Rule("top_p.range", GENERATE, "top_p", "outside (0, 1]", "top_p must lie in (0, 1], got {got}"),
    Rule("top_k.range", GENERATE, "top_k", "< 0 or not an int", "top_k must be an int >= 0 (0 or None: off), got {got!r}"),
    Rule("token_id.type", GENERATE, "(eos_token_id or pad_token_id)", "not an int, a list of ints, an integer tensor "
         "or None", "{name} must be an int token id >= 0, a list of them, or None, got {got!r}", InvalidType),
    Rule("token_id.range", GENERATE, "(eos_token_id or pad_token_id)", "a negative id",
         "{name} must hold token ids >= 0, got {got!r}"),
    Rule("generate.type", GENERATE, "(the argument named)",
         "a generation argument of the wrong type: do_sample, max_length, min_new_tokens, min_length, "
         "repetition_penalty, no_repeat_ngram_size, num_return_sequences, output_scores, output_logits, "
         "return_dict_in_generate, stopping_criteria, logits_processor, generation_config, generator, streamer",
         "{name} must be {allowed}, got {got!r}", InvalidType),
    Rule("generate.range", GENERATE, "(the argument named)", "a generation argument out of range (max_length < 1, "
         "a negative min_new_tokens / min_length / no_repeat_ngram_size, num_return_sequences < 1, "
         "repetition_penalty <= 0)", "{name} must be {allowed}, got {got!r}"),
    Rule("max_length.prompt", GENERATE, "max_length", "max_length (prompt + new tokens) not above the prompt's "
         "length", "max_length={got} leaves no new token after the prompt of {prompt} tokens (input_ids.shape[1]); "
         "raise it or pass max_new_tokens"),
    Rule("num_return_sequences.greedy", GENERATE, "num_return_sequences", "num_return_sequences > 1 without sampling",
         "num_return_sequences={got} needs do_sample=True: greedy decoding gives one sequence per prompt (beam "
         "search, which gives several, is not supported)"),
    Rule("generate.refused", GENERATE, "(the argument named)",
         "a transformers generation feature kvpass does not implement, at a non-default value: num_beams > 1, "
         "assistant_model, prompt_lookup_num_tokens, penalty_alpha, constraints, force_words_ids, stop_strings, "
         "output_attentions, output_hidden_states, use_cache=False, any other GenerationConfig field (bad_words_ids, "
         "typical_p, ...), given as an argument or in generation_config",
         "{name}={got!r} ({feature}) is not supported by kvpass: {advice}", InvalidType),
    Rule("generate.unknown", GENERATE, "(the argument named)", "an argument generate() does not know",
         "generate() got unsupported argument(s) {got}; supported: {names}", InvalidType),
    Rule("forward.value", MODEL, "(the argument named)",
         "labels not of input_ids' shape, a forward argument kvpass does not take (inputs_embeds, past_key_values, "
         "position_ids, output_attentions, output_hidden_states), logits_to_keep not an int >= 0",
         "{name} {problem}"),
    Rule("model.convert", MODEL, "(the model)", ".to() / .half() / .cuda() of a tensor-parallel KVPassModel, or "
         "load_state_dict",
         "{what} is not supported on a KVPassModel: {why}"),
    Rule("save.policy", MODEL, "(the model)", "save_pretrained of a model whose policy is not registered or whose "
         "hyperparameters JSON cannot hold, or whose base model has no save_pretrained",
         "save_pretrained cannot write {got}: {why}"),
    Rule("load.config", MODEL, "path", "kvpass.from_pretrained of a directory without kvpass_config.json, or with "
         "one kvpass did not write", "{got!r} is not a directory save_pretrained wrote ({why})"),
    Rule("export.budgets", "OnnxRunner.generate", "input_ids", "a prompt whose runtime budgets the export cannot run: "
         "other than the budgets fixed at export (budgets='fixed'), or outside the range the compress graph was "
         "traced for", "the prompt of {prompt} tokens ({total} with max_new_tokens) gets layer budgets {got} from the "
         "runtime, which this export cannot run: {why}"),
    Rule("export.value", "kvpass.export.onnx / tensorrt, OnnxRunner", "(the argument named)",
         "not a KVPassModel; max_length < 2 or beyond the context; example_length outside [2, max_length); a bad "
         "budget or budgets mode; an unknown tensorrt_check, precision or max_batch < 1; sliding-window layers or "
         "full-cache heads (ONNX); a policy whose runtime decisions the graphs cannot make (recall attention, the "
         "prompt compressed after the first step, layers kept whole, decode-time upkeep, a prepare step) or whose "
         "compress does not trace exactly with its budget as an input (budgets='runtime'); an out_dir without "
         "kvpass_export.json (OnnxRunner)",
         "(the message names the argument, the value and what is allowed: kvpass/export/onnx_export.py _validate, "
         "kvpass/export/tensorrt.py)"),
    # ------------------------------------------------------------------ calibration files (Chelsea's outlier heads)
    Rule("calibration.type", CALIBRATION, "calibration", "not a path, a shipped name or a Calibration",
         "calibration must be a path, a shipped model name or a Calibration, got {got!r}", InvalidType),
    Rule("calibration.missing", CALIBRATION, "calibration", "neither a file nor the name of a shipped calibration",
         "calibration {got!r} is neither a file nor a shipped calibration ({names}); write one with "
         "`kvpass calibrate`"),
    Rule("calibration.format", CALIBRATION, "calibration", "not JSON, or not the fields `kvpass calibrate` writes",
         "{got} is not a valid calibration file: {reason}"),
    Rule("calibration.model", CALIBRATION, "calibration",
         "made for a model of another shape (layers, KV heads, head dim, sliding-window layers)",
         "{where} {reason}; run `kvpass calibrate` for this model"),
    # ------------------------------------------------------------------ files (CLI)
    Rule("file.missing", "CLI (--prompt-file), calibration files", "(the file option)",
         "a path that does not exist or is not a readable file",
         "{name} {got!r} is not a readable file"),
    Rule("file.format", "calibration files (kvpass eval suite --calibration)", "(the file option)",
         "a file that is not the JSON object kvpass writes",
         "{name} {got!r} is not a kvpass calibration file: {reason}"),
    Rule("cli.set", "CLI --set", "--set", "not NAME=VALUE", "--set expects NAME=VALUE, got {got!r}"),
    Rule("cli.value", "CLI (every command)", "(the option named)",
         "an option's value outside what it allows (checked before any model loads)",
         "{name} must be {allowed}, got {got!r}"),
    # ------------------------------------------------------------------ state and resources
    Rule("generate.in_use", GENERATE, "(the model)", "another thread is generating with the same KVPassModel",
         "this KVPassModel is in use by another thread's generate(); wait for it, or kvpass.apply the model "
         "again for a second, independent KVPassModel (weights are shared)", ModelInUse),
    Rule("memory.estimate", GENERATE, "input_ids", "the prompt, batch and cache need more device memory than is "
         "free (estimated before the prefill, CUDA)",
         "input_ids ({batch} x {tokens} tokens) needs about {need_mib} MiB of device memory for the prefill and "
         "cache, {free_mib} MiB are free; {advice}", OutOfDeviceMemory),
    Rule("memory.oom", GENERATE, "input_ids", "a CUDA out-of-memory error during generate (the session is freed)",
         "out of device memory during generate (input_ids: {batch} x {tokens} tokens); the session was freed. "
         "{advice}",
         OutOfDeviceMemory),
)
RULE: dict[str, Rule] = {r.key: r for r in RULES}
MEMORY_ADVICE = "use a smaller batch, a shorter prompt, a smaller budget, or set KVPassModel.prefill_rows"


def refuse(key: str, **values) -> KVPassError:
    """The error of rule ``key`` with its message filled in (raise it: ``raise refuse(...)``)."""
    rule = RULE[key]
    argument = values.pop("argument", rule.argument)
    return rule.error(rule.message.format(**values), argument)


def errors_markdown() -> str:
    """docs/errors.md: the table of every refusal, from ``RULES``."""
    lines = ["# Errors kvpass raises for bad input", "",
             "Generated from `kvpass.validation.RULES` (`python -m kvpass.validation > docs/errors.md`); "
             "tests/test_validation.py checks that this file is what the table gives.", "",
             "Every refusal is a `kvpass.errors.KVPassError` and also the builtin you would catch: `InvalidValue` "
             "is a `ValueError`, `InvalidType` and the refused generation features a `TypeError`, `UnsupportedModel` "
             "a `ValueError`; `ModelInUse` and `OutOfDeviceMemory` are `RuntimeError`s. `err.argument` names the "
             "argument. `{...}` in a message is filled with the values.", "",
             "Issue 27's checklist, each class of bad input against the test that feeds it: "
             "[errors-coverage.md](errors-coverage.md).", "",
             "| key | entry points | argument | refused when | error | message |", "|---|---|---|---|---|---|"]
    for r in RULES:
        cells = [f"`{r.key}`", r.entry, f"`{r.argument}`", r.condition, r.error.__name__, r.message]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- the model
_ALIBI_TYPES = ("bloom", "mpt")


def check_model(model: object) -> None:
    """Refuse what is not a single-device, loaded, decoder-only transformers causal LM (a model kvpass already
    rewrote, rule "model.rewritten", is refused by ``kvpass.apply`` itself: the runtime sits above this module)."""
    if not isinstance(model, nn.Module):
        raise refuse("model.type", got=type(model).__name__)
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise refuse("model.config", got=name)
    if getattr(config, "is_encoder_decoder", False):
        raise refuse("model.encoder_decoder", got=name)
    if _is_transformers_model(model) and not _is_causal_lm(model):     # a custom module: the rewrite decides
        raise refuse("model.not_causal_lm", got=f"{name} ({getattr(config, 'model_type', '?')})")
    if getattr(config, "add_cross_attention", False):
        raise refuse("model.cross_attention", got=name)
    if getattr(config, "alibi", False) or getattr(config, "model_type", "") in _ALIBI_TYPES:
        raise refuse("model.score_bias", got=name, bias="ALiBi")
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise refuse("model.meta", got=name, names=", ".join(meta[:3]) + (", ..." if len(meta) > 3 else ""))
    devices = {str(p.device) for p in model.parameters()}
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict):
        devices |= {str(d) for d in device_map.values()}
    if len(devices) > 1:
        raise refuse("model.spread", got=name, devices=", ".join(sorted(devices)))
    if not devices:
        raise refuse("model.type", got=f"{name} without parameters")


def _is_transformers_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:                       # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel)


def _is_causal_lm(model: nn.Module) -> bool:
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return True
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:                       # pragma: no cover (transformers always has it)
        return False
    return name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


# ---------------------------------------------------------------------------------------------- policy, budget
def check_budget(budget: object) -> None:
    """A float fraction in (0, 1] or an int token count >= 1."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise refuse("budget.type", got=budget)
    if isinstance(budget, float) and not (0.0 < budget <= 1.0):
        raise refuse("budget.fraction", got=budget)
    if isinstance(budget, int) and budget < 1:
        raise refuse("budget.tokens", got=budget)


def check_budget_for_model(budget: float | int, context: int) -> None:
    """An int budget no larger than the model's context."""
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > context:
        raise refuse("budget.context", got=budget, context=context)


def check_kv_dtype(kv_dtype: object, device) -> None:
    """``kvpass.apply``'s kv_dtype: None or a format of ``kvpass.quantization.formats.KV_FORMATS``, and fp8 only where
    the device computes it (``fp8_unsupported``)."""
    from kvpass.quantization.formats import KV_FORMATS, fp8_unsupported

    if kv_dtype is None:
        return
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_FORMATS:
        raise refuse("kv_dtype.value", got=kv_dtype)
    why = fp8_unsupported(device) if kv_dtype == "fp8_e4m3" else None
    if why is not None:
        raise refuse("kv_dtype.device", got=why)


def check_optional_bool(rule: str, value: object) -> None:
    """True, False or None (``apply``'s fuse_linears and compile: None picks by device), else ``rule``'s refusal."""
    if value is not None and not isinstance(value, bool):
        raise refuse(rule, got=value)
