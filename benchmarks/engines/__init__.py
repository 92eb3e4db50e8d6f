"""Serving engines in the loop: vLLM and llama.cpp next to our engine."""
