"""Decoding: our engine's target forward, our decoders against Hugging Face's, drafting time per step."""
