"""Text: the tokenizer, the incremental detokenizer, the stop rules."""
