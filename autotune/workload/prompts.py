"""Prompt text of an exact length in the model's own tokens.

Synthetic workloads and token-count traces say how long a prompt is, not what it says. The
text is built from whole-word tokens of the model's vocabulary and checked by re-encoding, so
the server sees the length the trace asked for (chat templates add their own few tokens on
top, as they would in production). Requests of one ``prefix_group`` share the same prefix
text, so prefix caching sees real sharing; each request's own part is different, so it does
not see accidental sharing.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np

from autotune.errors import ConfigError
from autotune.workload.trace import Workload

__all__ = ["Tokenizer", "load_tokenizer", "PromptBuilder", "materialize"]


class Tokenizer:
    """The model's tokenizer.json, through the ``tokenizers`` library (no transformers needed)."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:  # pragma: no cover
            raise ConfigError("building prompts needs the tokenizers package: pip install 'autotune[tokenizer]'") from e
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the library's one error type for a file it cannot read: a bare Exception
            raise ConfigError(
                f"{path} is not a tokenizer the tokenizers library reads ({e}); pass the model "
                "directory that holds its tokenizer.json"
            ) from e
        self.path = path

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=False)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"no tokenizer.json at {path}; prompts of a token count need the model's tokenizer (pass --tokenizer DIR)"
        )
    return Tokenizer(path)


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        # Whole-word tokens ("Ġword" in byte-level BPE, "▁word" in sentencepiece) re-encode to
        # themselves when joined, which keeps lengths exact with few corrections.
        words = []
        for piece, i in self.tok.vocab.items():
            if piece[:1] in ("Ġ", "▁") and piece[1:].isalpha() and len(piece) > 2:
                words.append(i)
        if len(words) < 50:  # an unusual vocabulary: fall back to any token
            words = sorted(self.tok.vocab.values())
        if not words:
            raise ConfigError(f"the tokenizer {self.tok.path} has an empty vocabulary: prompts cannot be built with it")
        self._words = np.asarray(sorted(words))

    def text(self, n_tokens: int, seed: str | int, separator: str = "") -> str:
        """A text of exactly ``n_tokens`` tokens (when the tokenizer allows; else the closest below)."""
        if n_tokens <= 0:
            return ""
        rng = np.random.default_rng(_seed(seed))
        ids = rng.choice(self._words, size=n_tokens).tolist()
        text = self.tok.decode(ids).lstrip()
        for _ in range(8):
            got = self.tok.encode(separator + text)
            diff = n_tokens - (len(got) - len(self.tok.encode(separator)) if separator else len(got))
            if diff == 0:
                return text
            if diff < 0:
                ids = self.tok.encode(text)[: max(len(self.tok.encode(text)) + diff, 1)]
                text = self.tok.decode(ids)
            else:
                text += self.tok.decode(rng.choice(self._words, size=diff).tolist())
        return text


def _seed(seed: str | int) -> int:
    return int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:8], "little")


def materialize(workload: Workload, builder: PromptBuilder, seed: int = 0) -> Workload:
    """Give every request text: prefixes once per group, each request its own suffix."""
    prefixes: dict[tuple[str, int], str] = {}
    out = []
    for i, r in enumerate(workload.requests):
        if r.has_text:
            out.append(r)
            continue
        prefix = None
        if r.prefix_group is not None:
            key = (r.prefix_group, r.prefix_tokens)
            if key not in prefixes:
                prefixes[key] = builder.text(r.prefix_tokens, f"{seed}:prefix:{r.prefix_group}")
            prefix = prefixes[key]
        if r.prompt is None:
            own = (r.prompt_tokens or 1) - r.prefix_tokens
            prompt = builder.text(max(own, 1), f"{seed}:request:{i}", separator=(prefix + "\n") if prefix else "")
        else:
            prompt = r.prompt
        out.append(replace(r, prompt=prompt, prefix=prefix))
    return replace(workload, requests=tuple(out))
