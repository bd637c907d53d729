"""Prompt text of an exact length in the model's own tokens.

Synthetic workloads and token-count traces say how long a prompt is, not what it says. The
text is built from whole-word tokens of the model's vocabulary (``PromptBuilder`` says how its
length is kept exact), so the server sees the length the trace asked for (chat templates add
their own few tokens on top, as they would in production). Requests of one ``prefix_group`` share the same prefix
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

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode_each(self, ids: list[int]) -> list[str]:
        """Each token's own text."""
        return self._tok.decode_batch([[i] for i in ids], skip_special_tokens=True)

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


_HEAD = 16  # a text's own random first words (a KV-cache block of vLLM's default size)
_RUN_WORDS = 1 << 16  # the shared run of random words later ones are sliced from


class PromptBuilder:
    """Texts of an exact token count, from whole-word tokens of the model's vocabulary.

    A whole-word token ("Ġword" in byte-level BPE, "▁word" in sentencepiece) whose text encodes alone to itself
    is kept. Where the tokenizer's pre-tokenizer splits text at the space before a word (every byte-level and
    Metaspace tokenizer does, which the builder checks once on a sample of its words), n such words joined are n
    tokens: the text is built by joining their strings, with no encode per prompt. A tokenizer that merges
    across words instead gets texts checked and corrected by re-encoding, which is exact but slower.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        candidates = sorted(i for piece, i in tokenizer.vocab.items() if piece[:1] in ("Ġ", "▁") and len(piece) > 2)
        # a sentencepiece decoder drops the space of a text's first token: each word's text is its space and word
        texts = [" " + t.lstrip(" ") for t in tokenizer.decode_each(candidates)]
        kept = [
            (i, t)
            for i, t, ids in zip(candidates, texts, tokenizer.encode_batch(texts), strict=True)
            if t[1:].isalpha() and ids == [i]
        ]
        if len(kept) < 50:  # an unusual vocabulary: any token, checked and corrected per text
            ids = sorted(tokenizer.vocab.values())
            kept = list(zip(ids, tokenizer.decode_each(ids), strict=True))
        if not kept:
            raise ConfigError(f"the tokenizer {tokenizer.path} has an empty vocabulary: no prompt can be built with it")
        self._ids = np.asarray([i for i, _ in kept])
        self._texts = np.asarray([t for _, t in kept], dtype=object)
        self.joins_exactly = self._joins_exactly()
        # A long run of random words, of which a text past its own first words is a slice: a prompt of thousands of
        # tokens costs no more than a short one. Its first HEAD words are its own, so two texts that slice the run
        # at one place still differ from their first token (no prefix a cache could share).
        words = self._texts[np.random.default_rng(1).integers(len(self._ids), size=_RUN_WORDS)]
        self._run = "".join(words)
        self._bounds = np.concatenate(([0], np.cumsum([len(w) for w in words])))

    def _joins_exactly(self) -> bool:
        """Whether words joined encode to the words, alone and after a prefix's closing newline."""
        order = np.random.default_rng(0).permutation(len(self._ids))[:4000]
        ids, text = self._ids[order].tolist(), "".join(self._texts[order])
        newline = self.tok.encode("\n")
        return self.tok.encode(text) == ids and self.tok.encode(text + "\n" + text) == ids + newline + ids

    def text(self, n_tokens: int, seed: str | int, separator: str = "") -> str:
        """A text of exactly ``n_tokens`` tokens after ``separator`` (when the tokenizer allows; else the closest
        below). The separator is a shared prefix and its closing newline; it is not part of the text."""
        if n_tokens <= 0:
            return ""
        rng = np.random.default_rng(_seed(seed))
        head = min(n_tokens, _HEAD)
        text = "".join(self._texts[rng.integers(len(self._ids), size=head)])
        rest = n_tokens - head
        if rest > _RUN_WORDS // 2:
            text += "".join(self._texts[rng.integers(len(self._ids), size=rest)])
        elif rest:
            start = int(rng.integers(_RUN_WORDS - rest + 1))
            text += self._run[self._bounds[start] : self._bounds[start + rest]]
        return text if self.joins_exactly else self._corrected(text, n_tokens, rng, separator)

    def _corrected(self, text: str, n_tokens: int, rng: np.random.Generator, separator: str) -> str:
        base = len(self.tok.encode(separator)) if separator else 0
        for _ in range(8):
            diff = n_tokens - (len(self.tok.encode(separator + text)) - base)
            if diff == 0:
                break
            if diff < 0:
                ids = self.tok.encode(text)
                text = self.tok.decode(ids[: max(len(ids) + diff, 1)])
            else:
                text += "".join(self._texts[rng.integers(len(self._ids), size=diff)])
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
