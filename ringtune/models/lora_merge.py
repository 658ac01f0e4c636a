"""A LoRA run's weights merged into full ones: ``W + scale · B @ A`` per adapter (the sampler's snapshot and the
HF export of ``save_weights_for_sampler``).

An unembedding adapter on a model with tied embeddings changes the output weight only (the forward reads
the embedding matrix unchanged): the merged model is then *untied* (its config says
``tie_word_embeddings: false`` and it has its own ``lm_head.weight``), so the sampler computes exactly the
trained function. Merging is done in float64 and rounded once to the parameters' dtype.
"""

from __future__ import annotations

import dataclasses

import torch

from ringtune.models.decoder import CausalLM
from ringtune.models.lora import UNEMBED, LoraModel
from ringtune.models.lora_experts import EXPERT_PROJ, expert_weight_delta
from ringtune.models.precision import compute_like_trainer, layers_compute_dtype, layers_exact


def merged_config(lora: LoraModel):
    """The base's :class:`DecoderConfig`, untied when an unembedding adapter sits on tied embeddings."""
    config = lora.config
    if lora.unembed is None or not config.tie_word_embeddings:
        return config
    hf = dict(config.hf_config)
    hf["tie_word_embeddings"] = False
    if isinstance(hf.get("text_config"), dict):
        hf["text_config"] = {**hf["text_config"], "tie_word_embeddings": False}
    return dataclasses.replace(config, tie_word_embeddings=False, hf_config=hf)


@torch.no_grad()
def merged_weights(lora: LoraModel, base_model: CausalLM | None = None) -> dict[str, torch.Tensor]:
    """The adapted weights merged, as new tensors under their keys of :func:`merged_state`. ``base_model``: the
    weights to merge into (default the run's base; under expert parallelism a copy with every expert)."""
    base_model = lora.base if base_model is None else base_model
    base = base_model.state_dict()
    merged: dict[str, torch.Tensor] = {}
    for target, a, b in lora.adapters.named_pairs():
        if target.experts:  # [E, out, in] onto rows [start, start + out) of every expert's fused tensor
            key = f"{target.module}.{EXPERT_PROJ[target.name.rsplit('.', 1)[1]]}"
            if key not in merged:
                merged[key] = base[key].clone()
            rows = slice(target.start, target.start + target.out_features)
            weight = merged[key]
            weight[:, rows] = (weight[:, rows].double() + expert_weight_delta(lora.adapters, target)).to(weight.dtype)
            continue
        delta = (b.double() @ a.double()) * lora.adapters.scale
        if target.module == UNEMBED:
            weight = base_model.output_weight
            merged["lm_head.weight"] = (weight.double() + delta).to(weight.dtype)
            continue
        key = f"{target.module}.weight"
        weight = base[key]
        if target.start == 0 and target.out_features == weight.shape[0]:
            merged[key] = (weight.double() + delta).to(weight.dtype)
        else:  # one row block of a split module (GatedDeltaNet in_proj_q/k/v): copy once, then add per block
            if key not in merged:  # state_dict() tensors share the base's storage: never write into them
                merged[key] = weight.clone()
            rows = slice(target.start, target.start + target.out_features)
            merged[key][rows] = (merged[key][rows].double() + delta).to(weight.dtype)
    return merged


def merged_state(lora: LoraModel, base_model: CausalLM | None = None) -> dict[str, torch.Tensor]:
    """The merged model's state dict (keys of :class:`CausalLM` under :func:`merged_config`), new tensors for
    the adapted weights (:func:`merged_weights`), the base's own tensors (not copied) for the rest."""
    base_model = lora.base if base_model is None else base_model
    return {**base_model.state_dict(), **merged_weights(lora, base_model)}


def merged_model(lora: LoraModel) -> CausalLM:
    """An inference :class:`CausalLM` with the merged weights (no gradients, on the base's device), computing as
    the trainer's layers do under mixed precision (:func:`compute_like_trainer`)."""
    like = lora.base.output_weight
    with torch.device("meta"):
        model = CausalLM(merged_config(lora))
    merged = merged_weights(lora)  # new tensors already; the base's own are copied
    rest = {k: v.detach().clone() for k, v in lora.base.state_dict().items() if k not in merged}
    model.load_state_dict({**rest, **merged}, assign=True)
    model.to(device=like.device)
    model.requires_grad_(False)
    return compute_like_trainer(model.eval(), layers_compute_dtype(lora.base), exact=layers_exact(lora.base))
