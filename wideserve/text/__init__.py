"""Tokenizer, incremental detokenizer and chat templates."""
