"""The causal decoder for every target model: Qwen3.5 hybrids (GDN + gated attention) and dense Llama/Qwen3.

Module and parameter names follow transformers (``model.embed_tokens``, ``model.layers.{i}.linear_attn`` /
``self_attn`` / ``mlp`` / ``input_layernorm`` / ``post_attention_layernorm``, ``model.norm``, ``lm_head``),
so an HF state dict loads with no renaming. CP is applied by the :class:`PackedShard` passed to forward:
the same code runs a whole packed row or one rank's zigzag shard of it.
"""

from __future__ import annotations

import torch
from torch import nn

from ringtune.layout.mrope import rope_offsets
from ringtune.models.batch_cache import DecodeBatch, GatedDeltaRows, KVRows, LayerRows
from ringtune.models.cache import LayerCapture, PrefillCapture
from ringtune.models.config import DecoderConfig
from ringtune.models.layers.attention import Attention
from ringtune.models.layers.gated_deltanet import GatedDeltaNet
from ringtune.models.layers.mlp import SwiGLU
from ringtune.models.layers.moe import SparseMoE
from ringtune.models.layers.norms import RMSNorm
from ringtune.models.layers.rotary import RotaryEmbedding
from ringtune.models.logprob_head import label_logprobs
from ringtune.models.precision import layer_input, layer_output, layer_params, layer_round
from ringtune.models.recompute import DEFAULT_RECOMPUTE, run_decoder_layer
from ringtune.models.shard import PackedShard
from ringtune.models.vision.tower import VisionTower


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or attention) then the MLP (SwiGLU or sparse MoE, per config)."""

    def __init__(self, config: DecoderConfig, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        zero = config.family == "qwen3_5"
        self.layer_type = config.layer_types[index]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                hidden_size=config.hidden_size,
                num_k_heads=config.linear_num_key_heads,
                num_v_heads=config.linear_num_value_heads,
                head_k_dim=config.linear_key_head_dim,
                head_v_dim=config.linear_value_head_dim,
                conv_kernel=config.linear_conv_kernel_dim,
                rms_norm_eps=config.rms_norm_eps,
            )
        else:
            self.self_attn = Attention(
                hidden_size=config.hidden_size,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                qk_norm=config.qk_norm,
                output_gate=config.family == "qwen3_5",
                bias=config.attention_bias,
                rms_norm_eps=config.rms_norm_eps,
                rotary=rotary,
            )
        self.layer_index = index
        if config.mlp_types[index] == "moe":
            self.mlp: nn.Module = SparseMoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                config.shared_expert_intermediate_size,
            )
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centered=zero)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centered=zero)
        self.recompute = DEFAULT_RECOMPUTE  # activation recomputation mode (ringtune.models.recompute)
        self.compute_dtype: torch.dtype | None = None  # mixed precision (ringtune.models.precision); None: params'
        self.exact_arithmetic = False  # float64 between compute_dtype roundings (bf16-exact)

    def forward(self, x: torch.Tensor, shard: PackedShard, cache: LayerCapture | None = None) -> torch.Tensor:
        """:meth:`layer_forward` under this layer's recomputation mode ``self.recompute`` (plain with a ``cache``).

        With ``compute_dtype`` set (mixed precision) x is cast to it first, and so is the output; with exact
        arithmetic (``bf16-exact``) the layer computes in float64 between roundings to it
        (:mod:`ringtune.models.precision`) and returns ``compute_dtype``.
        """
        x = layer_input(self, x)
        if cache is not None:
            return layer_output(self, self.layer_forward(x, shard, cache))
        return layer_output(self, run_decoder_layer(self, x, shard, self.recompute))

    def layer_forward(self, x: torch.Tensor, shard: PackedShard, cache: LayerCapture | None = None) -> torch.Tensor:
        """x [T_local, hidden] -> [T_local, hidden]; the mixer talks over the shard's CP group.

        ``cache`` (prefill at CP = 1): the mixer hands it what decoding continues from. The parameters are
        read in ``compute_dtype`` (differentiable casts of the masters) when it is set.
        """
        mixer = self.linear_attn if self.layer_type == "linear_attention" else self.self_attn
        with layer_params(self, detached=shard.faults.detach_mixed_casts()):  # DEBUG-FAULT HOOK (False)
            x = layer_round(self, x + mixer(self.input_layernorm(x), shard, cache))
            return layer_round(self, x + self.mlp_out(self.post_attention_layernorm(x), shard))

    def mlp_out(self, h: torch.Tensor, shard: PackedShard) -> torch.Tensor:
        """The MLP on normed h [T_local, hidden]; a MoE layer replays ``shard.replay_experts[i]`` when given."""
        if isinstance(self.mlp, SparseMoE):
            replay = None if shard.replay_experts is None else shard.replay_experts[self.layer_index]
            return self.mlp(h, replay, shard.plan.is_real.to(h.device))
        return self.mlp(h)

    def decode(
        self, x: torch.Tensor, positions: torch.Tensor, rows: LayerRows, rotary: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One new token per sequence: x [B, hidden] at slots ``positions`` [B] -> [B, hidden]; updates ``rows``.
        ``rotary`` [B]: the rotary positions when they are not the slots (after images), else None.

        With ``compute_dtype`` set it computes as :meth:`forward` does: x cast first, parameters read in it.
        """
        x = layer_input(self, x)
        with layer_params(self):
            h = self.input_layernorm(x)
            if self.layer_type == "linear_attention":
                assert isinstance(rows, GatedDeltaRows)
                x = layer_round(self, x + self.linear_attn.decode(h, rows))
            else:
                assert isinstance(rows, KVRows)
                x = layer_round(self, x + self.self_attn.decode(h, positions, rows, rotary))
            return layer_output(self, layer_round(self, x + self.mlp(self.post_attention_layernorm(x))))


class _Body(nn.Module):
    """``model.*`` of the HF layout: embeddings, layers, final norm, and ``visual`` (the vision tower of a VL
    model; None for text only)."""

    def __init__(self, config: DecoderConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        # As transformers does (Llama, Qwen3, Qwen3.5): the pad token's row gets no gradient from the lookup.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centered=config.family == "qwen3_5")
        self.visual = None if config.vision is None else VisionTower(config.vision)


class CausalLM(nn.Module):
    """A decoder-only LM over packed shards; ``lm_head`` is absent when embeddings are tied."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(
            config.head_dim,
            theta=config.rope_theta,
            partial_rotary_factor=config.partial_rotary_factor,
            mrope_section=config.mrope_section,
        )
        self.model = _Body(config, self.rotary)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, False)

    @property
    def output_weight(self) -> torch.Tensor:
        """[vocab, hidden]: ``lm_head.weight``, or the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def check_parallel(self, shard: PackedShard) -> None:
        """Raise ParallelConfigError if this model's heads do not fit the shard's CP size and modes."""
        self.config.check_parallel(cp_size=shard.cp_size, attention=shard.attention, gated_delta=shard.gated_delta)

    def hidden_states(
        self, input_ids: torch.Tensor, shard: PackedShard, *, capture: PrefillCapture | None = None
    ) -> torch.Tensor:
        """input_ids int64 [T_local] (this rank's zigzag shard) -> final-normed hidden [T_local, hidden].

        Every rank of the shard's CP group must call it (and its backward) together. ``capture`` (a prefill
        for decoding, built on ``shard.plan``; at CP > 1 with the CP group, see :mod:`ringtune.models.cache`)
        collects every layer's K/V or GDN states; the hidden states of real tokens are those of the plain call.
        """
        if input_ids.shape != (shard.plan.local_len,):
            raise ValueError(
                f"input_ids must be [local_len={shard.plan.local_len}] (the shard); got {tuple(input_ids.shape)}"
            )
        self.check_parallel(shard)
        if shard.replay_experts is not None and len(shard.replay_experts) != len(self.model.layers):
            raise ValueError(
                f"shard.replay_experts must hold one entry per layer ({len(self.model.layers)}); "
                f"got {len(shard.replay_experts)}"
            )
        if capture is not None and (capture.plan is not shard.plan or len(capture.layers) != len(self.model.layers)):
            raise ValueError("capture must be PrefillCapture(shard.plan, num_layers) of this model and shard")
        if capture is not None and shard.images is not None:  # decoding continues each sequence's MRoPE count
            capture.rope_offsets = rope_offsets(
                shard.plan.seq_lens, shard.images.spans, shard.images.spatial_merge_size
            )
        x = self.input_embeddings(input_ids, shard)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, shard) if capture is None else layer(x, shard, capture.layers[i])
        return self.model.norm(x)

    def input_embeddings(self, input_ids: torch.Tensor, shard: PackedShard) -> torch.Tensor:
        """The decoder's input [T_local, hidden]: token embeddings, with the vision tower's embeddings in place of
        this rank's image tokens when ``shard.images`` is set (:mod:`ringtune.models.vision.placement`: the
        rank encodes the images it holds tokens of; no communication). Raises ValueError for images on a model
        without a vision tower."""
        x = self.model.embed_tokens(input_ids)
        images = shard.images
        if images is None:
            return x
        if self.model.visual is None:
            raise ValueError("this row has images but the model has no vision tower (a text-only checkpoint)")
        if images.local_index.numel() == 0:
            return x
        embeds = self.model.visual(images.pixel_values, images.grids)
        return x.index_copy(0, images.local_index, embeds.index_select(0, images.embed_index).to(x.dtype))

    def decode_hidden(self, input_ids: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One decode step: input_ids int64 [B] (row b's next token) -> final-normed hidden [B, hidden].

        The token of row b sits at slot ``batch.lengths[b]`` and is rotated at ``lengths[b] + rope_offsets[b]``
        (its sequence's MRoPE count after images; text tokens take three equal positions); every layer appends
        to / updates row b's cache, and ``batch.lengths`` advances by one. Single process, no autograd needed.
        """
        if input_ids.shape != (len(batch),):
            raise ValueError(f"input_ids must be [B={len(batch)}] (one token per row); got {tuple(input_ids.shape)}")
        batch.reserve(1)
        positions = batch.lengths.to(input_ids.device)
        rotary = None if not bool(batch.rope_offsets.any()) else positions + batch.rope_offsets.to(positions.device)
        x = self.model.embed_tokens(input_ids)
        for layer, rows in zip(self.model.layers, batch.layers, strict=True):
            x = layer.decode(x, positions, rows, rotary)
        batch.advance()
        return self.model.norm(x)

    def forward(
        self, input_ids: torch.Tensor, shard: PackedShard, targets: torch.Tensor, upstream: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Log-probs of ``targets``: log p(targets[t] | tokens up to t), through the tiled head.

        Args:
            input_ids: int64 [T_local], this rank's zigzag shard of a packed row.
            shard: the row's plan, positions (checked against the plan), CP group and modes.
            targets: int64 [T_local] or [T_local, K] (K candidates per position, one logits pass for all);
                IGNORE_INDEX (-100) marks an unscored entry (pads), which gets 0 and no gradient.
            upstream: the loss's gradient in the returned log-probs when known before the forward (targets'
                shape), or None: the head then makes its gradients in its forward tile pass
                (:func:`~ringtune.models.logprob_head.label_logprobs`; recomputed if the backward's differs).
        Returns:
            targets' shape, float32 (float64 for a float64 model); no [T × vocab] buffer is kept.
            Collective over the shard's CP group (forward and backward), like :meth:`hidden_states`.
        """
        return label_logprobs(self.hidden_states(input_ids, shard), self.output_weight, targets, upstream=upstream)

    def label_logprobs(self, input_ids: torch.Tensor, labels: torch.Tensor, shard: PackedShard) -> torch.Tensor:
        """:meth:`forward` with the arguments in (ids, labels, shard) order."""
        return self(input_ids, shard, labels)

    def logits(self, input_ids: torch.Tensor, shard: PackedShard) -> torch.Tensor:
        """Full logits [T_local, vocab] (tests and short prompts only: it is the buffer the head avoids)."""
        return self.hidden_states(input_ids, shard) @ self.output_weight.t()
