"""Decoder building blocks with Hugging Face parameter names; each runs on a :class:`PackedShard`."""
