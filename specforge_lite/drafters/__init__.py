"""Drafters: one module each (config, nn.Module, export). `DRAFTERS` maps names to modules."""
