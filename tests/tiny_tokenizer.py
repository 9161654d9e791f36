"""The tiny byte-level BPE tokenizer of the test models (a plain module, so tests anywhere
import it by name: ``from tiny_tokenizer import build_test_tokenizer``)."""

from __future__ import annotations

import functools
from typing import Any

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def forward(self, x):\n    return x * 2 + 1\n",
    "Continuous batching schedules decode tokens and prefill chunks together.",
    "0123456789 +-*/ = () [] {} <> '\" ; : , . ? !",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.cache
def build_test_tokenizer() -> Any:
    """A deterministic byte-level BPE (about 400 tokens) as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
