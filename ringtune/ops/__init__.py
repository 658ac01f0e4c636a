"""Sequence-mixing ops over packed THD rows: a plain reference beside each context-parallel variant."""
