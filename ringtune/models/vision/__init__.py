"""Qwen3.5's vision tower (transformers' ``model.visual``) and how images reach the decoder's tokens."""
