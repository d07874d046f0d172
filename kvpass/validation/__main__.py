"""``python -m kvpass.validation > docs/errors.md``: the table of every refusal."""

from kvpass.validation.rules import errors_markdown

print(errors_markdown(), end="")
