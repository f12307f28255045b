"""A character-level tokenizer in the LLaDA style, built with the `tokenizers` library.

Special tokens mirror LLaDA-8B's (BOS, EOS = pad, mask, end-of-turn, chat headers), and the
chat template is LLaDA's Llama-3-style turn format, so the demo model and the test models
exercise exactly the code paths a real LLaDA folder does.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BOS, EOS, MASK, EOT = "<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<|eot_id|>"
HEADER_START, HEADER_END, UNK = "<|start_header_id|>", "<|end_header_id|>", "<|unk|>"
SPECIAL_TOKENS = (BOS, EOS, MASK, EOT, HEADER_START, HEADER_END, UNK)
CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def build_char_tokenizer(characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    """Special tokens get ids 0..6, then one id per character, in `characters` order."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for ch in characters:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        unk_token=UNK,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_char_tokenizer(
    folder: str | Path, characters: str = CHARACTERS
) -> PreTrainedTokenizerFast:
    tokenizer = build_char_tokenizer(characters)
    tokenizer.save_pretrained(str(folder))
    return tokenizer
