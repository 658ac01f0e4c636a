"""A tiny random Llama with SmolLM2's real 49,152-token vocabulary and tokenizer, as an HF directory.

Chat text (the demo's ChatML, the cookbook's renderers) tokenizes as it would for SmolLM2-135M, while a
step costs milliseconds: 4 layers of hidden size 32 (about 3.2 M parameters, almost all embeddings).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ringtune.models.checkpoints.tokenizers import SMOLLM2_VOCAB, smollm2_tokenizer_dir
from ringtune.testing.tiny_models import hf_config


def tiny_smollm_dir(dest: Path, *, seed: int = 0) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (random, float32) and SmolLM2's tokenizer files to ``dest``."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config("llama")
    config.vocab_size = SMOLLM2_VOCAB
    config.max_position_embeddings = 4096
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, None
    transformers.LlamaForCausalLM(config).save_pretrained(dest)
    smollm2_tokenizer_dir(dest)
    return dest
