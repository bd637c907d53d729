#!/usr/bin/env python3
"""Build a tiny random-weight Llama with a BPE tokenizer trained on local text.

No hub access: the tokenizer learns from /usr/share/common-licenses (or --corpus files),
the weights are random (seeded). Real vLLM serves it on CPU, which is all the tests need:
real start-up, real scheduling, real streaming, real failure texts.

    .venv/bin/python scripts/build_tiny_model.py models/tiny-llama

Idempotent: an existing, complete model directory is left as it is (--force rebuilds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEFAULT_CORPUS = Path("/usr/share/common-licenses")


def corpus_files(paths: list[Path]) -> list[str]:
    files: list[str] = []
    for p in paths:
        if p.is_dir():
            files += sorted(str(f) for f in p.rglob("*") if f.is_file() and not f.is_symlink())
        elif p.is_file():
            files.append(str(p))
    return files


def build(out: Path, corpus: list[Path], vocab_size: int, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    files = corpus_files(corpus)
    if not files:
        sys.exit(f"build_tiny_model: no corpus text found in {', '.join(map(str, corpus))}; pass --corpus FILE_OR_DIR")

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, as in the models users tune
        max_position_embeddings=32768,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    (out / ".autotune-tiny-model").write_text(json.dumps({"seed": seed, "vocab_size": vocab_size}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="?", default=Path("models/tiny-llama"))
    ap.add_argument("--corpus", type=Path, action="append", help="text file or directory (repeatable)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if the model exists")
    args = ap.parse_args()
    done = args.out / ".autotune-tiny-model"
    if done.exists() and (args.out / "config.json").exists() and not args.force:
        print(f"build_tiny_model: {args.out} already built")
        return
    build(args.out, args.corpus or [DEFAULT_CORPUS], args.vocab_size, args.seed)
    print(f"build_tiny_model: wrote {args.out}")


if __name__ == "__main__":
    main()
