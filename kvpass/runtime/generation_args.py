"""``generate``'s arguments resolved in one place: ``resolve_generation_args`` takes what the caller passed, an
optional transformers ``GenerationConfig`` and the model's own, checks every value (``kvpass.validation``, before
any work) and returns ``GenerationArgs``.

Precedence, as transformers' ``generate``: an argument passed > the ``generation_config`` passed > the model's
``generation_config`` > the global default (transformers': top_k 50, temperature 1, top_p 1, ...). For
``eos_token_id`` / ``pad_token_id`` an explicit None means none. ``max_new_tokens`` wins over ``max_length``
(prompt + new tokens, the prompt counted with its padding, ``input_ids.shape[1]``), each taken from the first
source that sets either; where none does, 20 new tokens (transformers' max_length of 20 would count the prompt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpass.sampling import Processor, logits_processors
from kvpass.validation import (
    check_callables,
    check_flag,
    check_generate_kwargs,
    check_generation_config_fields,
    check_instance,
    check_int,
    check_max_new_tokens,
    check_repetition_penalty,
    check_sampling,
    check_streamer,
    check_token_ids,
    refuse,
)

UNSET = object()           # an argument left out, as opposed to an explicit None
# transformers generate() / GenerationConfig names kvpass implements
SUPPORTED = ("max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k",
             "top_p", "repetition_penalty", "no_repeat_ngram_size", "num_return_sequences", "eos_token_id",
             "pad_token_id", "return_dict_in_generate", "output_scores", "output_logits")
# kvpass's own generate() arguments
KVPASS_ARGS = ("generator", "prefill_chunk", "context")
GENERATE_ARGS = ("input_ids", "attention_mask", "generation_config", "stopping_criteria", "logits_processor",
                 "streamer", *SUPPORTED, *KVPASS_ARGS)
DEFAULT_NEW_TOKENS = 20
GLOBAL_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0,
                   "no_repeat_ngram_size": 0, "min_new_tokens": 0, "min_length": 0, "num_return_sequences": 1,
                   "return_dict_in_generate": False, "output_scores": False, "output_logits": False}


@dataclass
class GenerationArgs:
    """What one ``generate`` call does, every value checked. ``prompt_length``: input_ids.shape[1] (padding
    included, as transformers counts it)."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    repetition_penalty: float
    no_repeat_ngram_size: int
    min_new_tokens: int
    min_length: int
    num_return_sequences: int
    eos_ids: list[int]
    pad_id: int
    prompt_length: int
    return_dict_in_generate: bool = False
    output_scores: bool = False
    output_logits: bool = False
    stopping_criteria: list[Callable] = field(default_factory=list)
    logits_processor: list[Processor] = field(default_factory=list)
    streamer: object = None
    generator: torch.Generator | None = None
    prefill_chunk: object = UNSET             # kvpass: UNSET -> the model's ``prefill_chunk``
    context: object = None                    # kvpass: a ``compress_context`` cache the questions are asked of
    pads: torch.Tensor | None = None          # [B] the prompt's left padding, where an attention_mask was given

    def processors(self) -> list[Processor]:
        """The logits processors of these settings, transformers' order (``kvpass.sampling``)."""
        return logits_processors(self.repetition_penalty, self.no_repeat_ngram_size, self.min_length,
                                 self.min_new_tokens, self.prompt_length, self.eos_ids, self.logits_processor,
                                 self.pads)

    @property
    def needs_sequences(self) -> bool:
        """Whether each step needs the whole sequence so far (a processor or a stopping criterion reads it)."""
        return bool(self.processors() or self.stopping_criteria)


def resolve_generation_args(model, prompt_length: int, passed: dict, generation_config=None, stopping_criteria=None,
                            logits_processor=None, streamer=None) -> GenerationArgs:
    """Check and resolve generate's arguments. ``passed``: every other keyword argument the caller gave (the
    ones transformers knows and kvpass does not are refused by name, unknown ones as unknown)."""
    from transformers import GenerationConfig

    check_instance("generation_config", generation_config, GenerationConfig, "a transformers GenerationConfig or None")
    given = {k: passed[k] for k in passed if k in SUPPORTED or k in KVPASS_ARGS}
    check_generate_kwargs({k: v for k, v in passed.items() if k not in given}, GENERATE_ARGS)
    if generation_config is not None:
        check_generation_config_fields(generation_config, SUPPORTED)
    configs = [c for c in (generation_config, getattr(model, "generation_config", None)) if c is not None]

    def pick(name: str):
        if given.get(name) is not None:
            return given[name]
        for config in configs:
            value = getattr(config, name, None)
            if value is not None:
                return value
        return GLOBAL_DEFAULTS.get(name)

    def token_ids(name: str) -> list[int]:
        if name in given:                               # an explicit None: none
            return check_token_ids(name, given[name])
        return check_token_ids(name, next((getattr(c, name) for c in configs if getattr(c, name, None) is not None),
                                          None))

    do_sample, temperature, top_k, top_p = pick("do_sample"), pick("temperature"), pick("top_k"), pick("top_p")
    check_sampling(do_sample, temperature, top_k, top_p)
    eos_ids = token_ids("eos_token_id")
    pads = token_ids("pad_token_id")
    n_return = check_int("num_return_sequences", pick("num_return_sequences"), 1)
    if n_return > 1 and not do_sample:
        raise refuse("num_return_sequences.greedy", got=n_return)
    generator = given.get("generator")
    check_instance("generator", generator, torch.Generator, "a torch.Generator or None")
    check_streamer(streamer)
    return GenerationArgs(
        max_new_tokens=_new_tokens(given, configs, prompt_length), do_sample=do_sample, temperature=float(temperature),
        top_k=top_k, top_p=top_p, repetition_penalty=check_repetition_penalty(pick("repetition_penalty")),
        no_repeat_ngram_size=check_int("no_repeat_ngram_size", pick("no_repeat_ngram_size"), 0),
        min_new_tokens=check_int("min_new_tokens", pick("min_new_tokens"), 0),
        min_length=check_int("min_length", pick("min_length"), 0), num_return_sequences=n_return,
        eos_ids=eos_ids, pad_id=pads[0] if pads else (eos_ids[0] if eos_ids else 0), prompt_length=prompt_length,
        return_dict_in_generate=check_flag("return_dict_in_generate", pick("return_dict_in_generate")),
        output_scores=check_flag("output_scores", pick("output_scores")),
        output_logits=check_flag("output_logits", pick("output_logits")),
        stopping_criteria=check_callables("stopping_criteria", stopping_criteria),
        logits_processor=check_callables("logits_processor", logits_processor), streamer=streamer,
        generator=generator, prefill_chunk=given.get("prefill_chunk", UNSET), context=given.get("context"))


def _new_tokens(given: dict, configs: list, prompt_length: int) -> int:
    """max_new_tokens, from the first source that sets max_new_tokens or max_length (module docstring)."""
    sources = [given, *[{n: getattr(c, n, None) for n in ("max_new_tokens", "max_length")} for c in configs]]
    for source in sources:
        if source.get("max_new_tokens") is not None:
            return check_max_new_tokens(source["max_new_tokens"])
        if source.get("max_length") is not None:
            total = check_int("max_length", source["max_length"], 1)
            if total <= prompt_length:
                raise refuse("max_length.prompt", got=total, prompt=prompt_length)
            return total - prompt_length
    return DEFAULT_NEW_TOKENS
