"""The toy world's word-level tokenizers, saved in the Hugging Face format.

One vocabulary: every word and punctuation mark of the toy captions plus special tokens. Two
flavours of post-processing, for the two roles a tokenizer plays in the DiT families:
``clip`` wraps a caption as ``<bos> ... <eos>`` (CLIP pools at the end-of-text token),
``t5`` appends ``</s>`` (T5's convention). They load with ``AutoTokenizer`` / the pipelines'
own loaders like any tokenizer; transformers' CLIP processor accepts them too.
"""

from __future__ import annotations

from typing import Literal

from jagg_pipeline.rewards.toy_scene import ALL_ATTRIBUTES

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIALS = (PAD, UNK, BOS, EOS)
# Captions are at most 11 words and marks; room for the specials and a little slack.
MAX_LENGTH = 16


def vocabulary() -> dict[str, int]:
    """Specials first (pad = 0), then the caption words and marks in sorted order."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.Whitespace()
    words = {piece for a in ALL_ATTRIBUTES for piece, _ in split.pre_tokenize_str(a.caption())}
    return {token: index for index, token in enumerate((*SPECIALS, *sorted(words)))}


def word_tokenizer(role: Literal["clip", "t5"] = "clip", max_length: int = MAX_LENGTH):
    """A ``PreTrainedTokenizerFast`` over :func:`vocabulary` for a CLIP- or T5-style encoder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary()
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if role == "clip":
        template = f"{BOS} $A {EOS}"
        specials = [(BOS, vocab[BOS]), (EOS, vocab[EOS])]
    elif role == "t5":
        template = f"$A {EOS}"
        specials = [(EOS, vocab[EOS])]
    else:
        raise ValueError(f"role must be 'clip' or 't5', got {role!r}")
    backend.post_processor = processors.TemplateProcessing(single=template, special_tokens=specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        model_max_length=max_length,
    )
