"""A Hugging Face model whose next-token choice is known exactly: it predicts that the last word repeats.

A GPT-2 whose transformer blocks and position embeddings are zero, so the hidden state at a position is the
embedding of its token. The embeddings are distinct rows of a Sylvester-Hadamard matrix (entries +-1, mean 0,
variance 1: the final layer norm leaves them unchanged; rows mutually orthogonal), and the (untied) output layer
is ``SCALE`` times the same matrix, so the logits after word ``w`` are ``SCALE * <e(v), e(w)>``: ``SCALE * DIM``
for ``v = w`` and 0 for every other word. The model therefore repeats the last word: ``log p(w | w) =
SCALE * DIM - log(exp(SCALE * DIM) + V - 1)`` and every other word is ``SCALE * DIM`` nats less likely. The
tokenizer is word-level (one token per word), so a test can tell which answer each ICL task type must pick.
"""

from __future__ import annotations

import os

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]
SPECIAL = ["<|endoftext|>", "[UNK]"]
DIM = 32
SCALE = 0.5


def hadamard(n: int):
    """The n x n Sylvester-Hadamard matrix (n a power of two) as a float tensor."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def write_repeat_model(out_dir: str, max_seq_len: int = 64) -> str:
    """Write the model and its tokenizer to ``out_dir`` (``save_pretrained`` layout); return ``out_dir``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  unk_token="[UNK]",
                                  model_max_length=max_seq_len, model_input_names=["input_ids", "attention_mask"])
    cfg = GPT2Config(vocab_size=len(vocab), n_positions=max_seq_len, n_embd=DIM, n_layer=1, n_head=1,
                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    rows = hadamard(DIM)[1:1 + len(vocab)]  # row 0 (all ones) has mean 1: left out
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.wte.weight.copy_(rows)
        model.transformer.ln_f.weight.fill_(1.0)
        for block in model.transformer.h:
            block.ln_1.weight.fill_(1.0)
            block.ln_2.weight.fill_(1.0)
        model.lm_head.weight.copy_(SCALE * rows)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
