"""Speculative decoding (batch 1) over Hugging Face causal LMs."""
