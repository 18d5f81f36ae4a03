"""Regenerate the tokenizer the project ships (``mllm_rl/assets/tokenizer``).

A byte-level BPE with no merges: 256 byte tokens (ids 0-255, by code point of the byte-level
alphabet) and three ChatML special tokens; every UTF-8 string round-trips, no training data needed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build() -> PreTrainedTokenizerFast:
    alphabet = ByteLevel.alphabet()
    byte_order = sorted(alphabet, key=lambda ch: (ord(ch) > 255, ord(ch)))
    vocab = {ch: i for i, ch in enumerate(byte_order)}
    assert len(vocab) == 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[1] / "mllm_rl" / "assets" / "tokenizer"
    ap.add_argument("--out", type=Path, default=default)
    args = ap.parse_args()
    build().save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
