"""Checkpoint formats: HF safetensors in/out, llama.cpp GGUF files, HF tokenizer directories."""
