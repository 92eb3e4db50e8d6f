"""Sampling: the sample stage's backends against each other and HF `generate`."""
