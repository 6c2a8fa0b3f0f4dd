#!/usr/bin/env python3
"""Writes tests/tokenize/tiny-tokenizer.json: a small byte-level BPE in the Hugging Face format,
with Llama 3's special tokens and a post-processor that prepends <|begin_of_text|>, as Llama 3's
does. Trained on a fixed text, so the file is reproducible; committed, so tests need no download.

    python3 tests/tokenize/make_tiny_tokenizer.py   (needs the `tokenizers` package)
"""
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TEXT = [
    "You are a helpful assistant. Answer the question briefly and politely.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Routing requests to the worker that holds their prefix saves the prefill of that prefix.",
    "time year people way day man thing woman life child world school state family student",
] * 20

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(TEXT, trainer)
bos = tok.token_to_id("<|begin_of_text|>")
tok.post_processor = processors.TemplateProcessing(
    single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
    special_tokens=[("<|begin_of_text|>", bos)])
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny-tokenizer.json")
tok.save(out)
print(out, os.path.getsize(out), "bytes")
