"""Policy specs as users write them: ``name`` or ``name[key=value,...]`` (``split_spec``), values parsed
(``parse_value``). The registry (``kvpass.policies.get_policy``) and wrapper policies (``adakv``'s inner policy)
read them."""

from __future__ import annotations


def parse_value(text: str) -> object:
    """A hyperparameter's text as a user writes it: an int, a float, true/false, else the string."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return text.lower() == "true" if text.lower() in ("true", "false") else text


def split_spec(spec: str) -> tuple[str, dict[str, object]]:
    """A policy spec, ``name`` or ``name[key=value,...]`` (e.g. ``d2o[scores=window,merge_bias=true]``:
    how the evaluations name a configuration), -> (name, hyperparameters)."""
    from kvpass.validation import refuse

    name, _, rest = spec.partition("[")
    if not rest:
        return spec, {}
    if not rest.endswith("]"):
        raise refuse("policy.spec", got=spec)
    kwargs: dict[str, object] = {}
    for item in filter(None, rest[:-1].split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise refuse("policy.spec", got=spec)
        kwargs[key.strip()] = parse_value(value.strip())
    return name, kwargs
