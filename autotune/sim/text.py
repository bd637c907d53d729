"""Prompts and generated text as tokens: vllm-sim's stand-in for a tokenizer and for sampling.

Prompts are counted with the model's tokenizer when there is one (``tokenizer.json``),
otherwise as ~4 bytes a token; the token ids feed chained per-block hashes
(``scheduler.block_hashes``), so requests that share a prefix share KV blocks through the
prefix cache. Without ``ignore_eos`` a request may end early at a simulated EOS: each token is
EOS with probability ``1/EOS_MEAN_TOKENS``, drawn from a generator seeded with the prompt's
tokens (and the request's ``seed``), so the same request always gets the same length, as under
greedy decoding. The generated text is one short word piece per token.
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["EOS_MEAN_TOKENS", "TextCodec", "chat_prompt", "eos_length", "token_text"]

EOS_MEAN_TOKENS = 256  # mean output length when EOS is not ignored (EOS probability 1/256 a token)
# Generated text: one short word piece per token, always non-empty (benchmarks count chunks with text).
WORDS = (
    " the",
    " of",
    " and",
    " to",
    " in",
    " a",
    " is",
    " that",
    " for",
    " it",
    " as",
    " was",
    " with",
    " be",
    " by",
    " on",
    " not",
    " he",
    " this",
    " are",
    " or",
    " his",
    " from",
    " at",
    " which",
    " but",
    " have",
    " an",
    " had",
    " they",
    " you",
    " were",
    " their",
    " one",
    " all",
    " we",
    " can",
    " her",
    " has",
    " there",
    " been",
    " if",
    " more",
    " when",
    " will",
    " would",
    " who",
    " so",
    " no",
    " time",
    " out",
    " up",
    " new",
    " some",
    " could",
    " these",
    " two",
    " may",
    " first",
    " then",
    " do",
    " any",
    " like",
    " my",
)


class TextCodec:
    """Text -> token ids: the model's tokenizer when there is one, else ~4 bytes a token."""

    def __init__(self, tokenizer_file: str | None = None) -> None:
        self.path = tokenizer_file
        self._tok = None
        if tokenizer_file:
            # imported only when a tokenizer is given: tokenizers is an optional dependency
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(tokenizer_file)

    @staticmethod
    def find(tokenizer: str | None, model: str) -> str | None:
        """tokenizer.json from --tokenizer (a file or a directory), else from the model's files (a directory, or
        the Hugging Face cache, found as vLLM finds them)."""
        from autotune.engine.model import locate

        for cand in (tokenizer, model, model and locate(model).directory):
            if not cand:
                continue
            p = Path(cand)
            if p.is_file():
                return str(p)
            if (p / "tokenizer.json").is_file():
                return str(p / "tokenizer.json")
        return None

    def encode(self, text: str) -> list[int]:
        if self._tok is not None:
            return list(self._tok.encode(text).ids)
        # Pseudo token ids: one per 4-byte chunk (the last chunk takes the 1-3 bytes left over), so
        # equal text prefixes give equal ids and the count is what virtual.py assumes for text traces.
        b = text.encode()
        k = max(1, len(b) // 4)
        return [int.from_bytes(b[4 * i : 4 * i + 4] if i < k - 1 else b[4 * i :], "little") for i in range(k)]


def chat_prompt(messages: Sequence[dict[str, Any]]) -> str:
    """A simple chat template (the tiny test model's): ``<|role|>\\ncontent\\n`` per message, then the assistant's
    turn."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content or ''}\n")
    return "".join(parts) + "<|assistant|>\n"


def eos_length(token_ids: Sequence[int], seed: int | None = None, min_tokens: int = 0) -> int:
    """Where a request would emit EOS: geometric with mean EOS_MEAN_TOKENS, fixed by the prompt (and seed)."""
    # a digest, not hash(): the same request must end at the same length in every process
    digest = hashlib.blake2b(
        array("Q", (t & 0xFFFFFFFFFFFFFFFF for t in token_ids)).tobytes(), digest_size=8, key=str(seed).encode()[:64]
    ).digest()
    u = random.Random(int.from_bytes(digest, "little")).random()
    # inverse CDF of the geometric distribution with p = 1/EOS_MEAN_TOKENS, lengths from 1
    n = 1 + int(math.log(1.0 - u) / math.log(1.0 - 1.0 / EOS_MEAN_TOKENS))
    return max(n, min_tokens, 1)


def token_text(seed: int, j: int) -> str:
    return WORDS[(seed + j * 7) % len(WORDS)]
