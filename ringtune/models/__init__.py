"""Model architectures and checkpoint formats: decoders, their layers, HF safetensors and GGUF in/out."""
