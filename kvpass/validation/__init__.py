"""One validation layer for every entry point: what each argument accepts, checked before any work starts.

``kvpass.validation.rules`` holds ``RULES``, the table of every refusal (docs/errors.md is generated from it),
and ``refuse``; the checks live by topic beside it: the model, policy and budget in ``rules``, the prompt in
``inputs``, generate's arguments in ``generation``, command-line options and files in ``files``, device memory
in ``resources``. Everything is importable from ``kvpass.validation``.
"""

from kvpass.validation.files import check_option, check_readable_file
from kvpass.validation.generation import (
    NEUTRAL_CONFIG_FIELDS,
    REFUSED_GENERATE_ARGS,
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
)
from kvpass.validation.inputs import as_input_ids, left_pads
from kvpass.validation.resources import check_memory, estimate_prefill_bytes, free_device_bytes, in_use
from kvpass.validation.rules import (
    APPLY,
    CALIBRATION,
    GENERATE,
    MEMORY_ADVICE,
    RULE,
    RULES,
    Rule,
    check_budget,
    check_budget_for_model,
    check_kv_dtype,
    check_model,
    check_optional_bool,
    errors_markdown,
    refuse,
)

__all__ = [
    "APPLY", "CALIBRATION", "GENERATE", "MEMORY_ADVICE", "NEUTRAL_CONFIG_FIELDS", "REFUSED_GENERATE_ARGS", "RULE",
    "RULES", "Rule", "as_input_ids", "check_budget", "check_budget_for_model", "check_kv_dtype", "check_callables", "check_flag",
    "check_generate_kwargs", "check_generation_config_fields", "check_instance", "check_int", "check_max_new_tokens",
    "check_memory", "check_model", "check_option", "check_optional_bool", "check_readable_file",
    "check_repetition_penalty", "check_sampling", "check_streamer", "check_token_ids", "errors_markdown",
    "estimate_prefill_bytes", "free_device_bytes", "in_use", "left_pads", "refuse",
]
