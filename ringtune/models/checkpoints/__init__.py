"""Checkpoint readers: llama.cpp GGUF files and the tokenizers that go with the test checkpoints."""
