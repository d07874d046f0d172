"""Checks of ``generate``'s arguments: what transformers' ``generate`` takes that kvpass implements, what it refuses
by name (beam search, assisted decoding...), and each value's type and range. ``kvpass.runtime.generation_args``
resolves the arguments in one place and calls these."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvpass.validation.rules import refuse

# transformers generate() arguments kvpass refuses by name unless at their neutral value: (neutral, feature, advice)
REFUSED_GENERATE_ARGS: dict[str, tuple[object, str, str]] = {
    "num_beams": (1, "beam search", "decode greedily or sample (num_beams=1): a beam keeps several caches, each "
                  "compressed on its own, which kvpass does not track"),
    "num_beam_groups": (1, "diverse beam search", "decode greedily or sample"),
    "assistant_model": (None, "assisted (speculative) decoding", "call generate without an assistant"),
    "prompt_lookup_num_tokens": (None, "prompt-lookup decoding", "leave it unset"),
    "penalty_alpha": (None, "contrastive search", "leave it unset"),
    "constraints": (None, "constrained beam search", "leave it unset"),
    "force_words_ids": (None, "constrained beam search", "leave it unset"),
    "stop_strings": (None, "stopping at strings (needs the tokenizer)", "pass stopping_criteria, or eos_token_id"),
    "output_attentions": (False, "returning attention weights", "the compressed cache has no full attention map"),
    "output_hidden_states": (False, "returning hidden states", "run the original model for hidden states"),
    "use_cache": (True, "decoding without a cache", "kvpass always decodes over its compressed cache"),
    "past_key_values": (None, "a transformers cache", "kvpass holds its own cache; pass the whole prompt"),
}
# GenerationConfig fields that do not change which tokens come out (metadata, cache choices kvpass replaces)
NEUTRAL_CONFIG_FIELDS = frozenset({
    "transformers_version", "_from_model_config", "bos_token_id", "decoder_start_token_id", "cache_implementation",
    "cache_config", "compile_config", "disable_compile", "return_legacy_cache", "is_assistant", "trust_remote_code",
    "prefill_chunk_size", "generation_kwargs", "base_model_prefix", "target_lookbehind", "assistant_lookbehind",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold", "low_memory",
    "token_healing", "dola_layers", "_commit_hash", "assistant_early_exit", "max_matching_ngram_size",
    "early_stopping", "length_penalty", "diversity_penalty", "continuous_batching_config",
})


def check_generate_kwargs(unsupported: dict[str, object], supported: tuple[str, ...]) -> None:
    """Refuse every extra generate() argument: a known transformers feature by name (unless neutral), any other
    field of transformers' GenerationConfig at a non-neutral value (a feature kvpass does not implement), else as
    unknown."""
    unknown = []
    for name, value in unsupported.items():
        if name in REFUSED_GENERATE_ARGS:
            neutral, feature, advice = REFUSED_GENERATE_ARGS[name]
            if value is None and neutral is not None and name != "use_cache":
                continue                                    # transformers' "unset"
            if value == neutral or value is neutral:
                continue
            raise refuse("generate.refused", argument=name, name=name, got=value, feature=feature, advice=advice)
        if name in _config_field_defaults():
            if value is None or value == _config_field_defaults()[name]:
                continue
            raise refuse("generate.refused", argument=name, name=name, got=value,
                         feature="a transformers generation option kvpass does not implement",
                         advice=f"leave it unset; supported: {', '.join(supported)}")
        unknown.append(name)
    if unknown:
        raise refuse("generate.unknown", argument=", ".join(sorted(unknown)), got=", ".join(sorted(unknown)),
                     names=", ".join(supported))


def check_generation_config_fields(config, supported: tuple[str, ...]) -> None:
    """A ``generation_config=`` passed to generate: every field set to a non-neutral value must be one kvpass
    implements (the refusal names ``generation_config.<field>``)."""
    defaults = _config_field_defaults()
    for name, value in config.to_dict().items():
        if name in supported or name in NEUTRAL_CONFIG_FIELDS or value is None or name.startswith("_"):
            continue
        if name in REFUSED_GENERATE_ARGS:
            neutral, feature, advice = REFUSED_GENERATE_ARGS[name]
        else:
            neutral, feature, advice = defaults.get(name), "a transformers generation option kvpass does not implement", \
                "leave it unset"
        if value == neutral or (name in defaults and value == defaults[name]):
            continue
        raise refuse("generate.refused", argument=f"generation_config.{name}", name=f"generation_config.{name}",
                     got=value, feature=feature, advice=advice)


def _config_field_defaults() -> dict[str, object]:
    """transformers' GenerationConfig fields with their neutral values (the global defaults, else None)."""
    global _DEFAULTS
    if _DEFAULTS is None:
        from transformers import GenerationConfig

        out = dict(GenerationConfig().to_dict())
        getter = getattr(GenerationConfig, "_get_default_generation_params", None)
        out.update(getter() if getter is not None else {})
        _DEFAULTS = {k: v for k, v in out.items() if not k.startswith("_")}
    return _DEFAULTS


_DEFAULTS: dict[str, object] | None = None


def check_max_new_tokens(value: object) -> int:
    """An int >= 1 (a one-element integer tensor too)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
            value = int(value)
        else:
            raise refuse("max_new_tokens.type", got=value)
    if value < 1:
        raise refuse("max_new_tokens.range", got=value)
    return value


def check_sampling(do_sample: object, temperature: object, top_k: object, top_p: object) -> None:
    if not isinstance(do_sample, bool):
        raise refuse("generate.type", argument="do_sample", name="do_sample", allowed="True or False", got=do_sample)
    if do_sample and not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
                          and math.isfinite(temperature) and temperature > 0):
        raise refuse("temperature.range", got=temperature)
    if top_p is not None and not (isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0 < top_p <= 1):
        raise refuse("top_p.range", got=top_p)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise refuse("top_k.range", got=top_k)


def check_token_ids(name: str, value: object) -> list[int]:
    """``eos_token_id`` / ``pad_token_id``: None (none), an int >= 0, a list of them or an integer tensor ->
    the ids as a list."""
    if value is None:
        return []
    if isinstance(value, Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool or value.dim() > 1:
            raise refuse("token_id.type", argument=name, name=name, got=value)
        value = value.reshape(-1).tolist()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise refuse("token_id.type", argument=name, name=name, got=value)
        if item < 0:
            raise refuse("token_id.range", argument=name, name=name, got=value)
    return [int(i) for i in items]


def check_int(name: str, value: object, low: int) -> int:
    """An int >= ``low`` (rules ``generate.type`` / ``generate.range``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise refuse("generate.type", argument=name, name=name, allowed=f"an int >= {low}", got=value)
    if value < low:
        raise refuse("generate.range", argument=name, name=name, allowed=f"an int >= {low}", got=value)
    return value


def check_flag(name: str, value: object) -> bool:
    """True or False (``output_scores``, ``return_dict_in_generate``...)."""
    if not isinstance(value, bool):
        raise refuse("generate.type", argument=name, name=name, allowed="True or False", got=value)
    return value


def check_repetition_penalty(value: object) -> float:
    """A finite number > 0 (1.0: off; transformers' RepetitionPenaltyLogitsProcessor)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refuse("generate.type", argument="repetition_penalty", name="repetition_penalty",
                     allowed="a number > 0 (1.0: off)", got=value)
    if not (math.isfinite(value) and value > 0):
        raise refuse("generate.range", argument="repetition_penalty", name="repetition_penalty",
                     allowed="a number > 0 (1.0: off)", got=value)
    return float(value)


def check_callables(name: str, value: object) -> list:
    """``stopping_criteria`` / ``logits_processor``: None, one callable, or a list of them (transformers'
    ``StoppingCriteriaList`` / ``LogitsProcessorList`` are lists) -> a list."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(callable(x) for x in items):
        raise refuse("generate.type", argument=name, name=name,
                     allowed="a callable (input_ids, scores) or a list of them (transformers' "
                             f"{'StoppingCriteriaList' if 'stopping' in name else 'LogitsProcessorList'})",
                     got=value)
    return items


def check_instance(name: str, value: object, kind: type | tuple[type, ...], allowed: str) -> None:
    """None or an instance of ``kind`` (``generation_config``, ``generator``)."""
    if value is not None and not isinstance(value, kind):
        raise refuse("generate.type", argument=name, name=name, allowed=allowed, got=type(value).__name__)


def check_streamer(value: object) -> None:
    """None or an object with ``put`` and ``end`` (transformers' TextStreamer)."""
    if value is not None and not (callable(getattr(value, "put", None)) and callable(getattr(value, "end", None))):
        raise refuse("generate.type", argument="streamer", name="streamer",
                     allowed="an object with put(ids) and end() (transformers' TextStreamer)", got=type(value).__name__)
