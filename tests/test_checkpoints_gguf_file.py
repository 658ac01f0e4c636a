"""GGUF reader on a small file written here byte by byte: metadata of every kind and each decoded type.

The expected values are computed from the block definitions (d * q + m), not by another reader, so the
test pins the format itself. The real SmolLM2 file is covered by test_checkpoints_gguf.py.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from ringtune.models.checkpoints.gguf_file import GGUFFile, GGUFFormatError, dequantize


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def _write_gguf(path: Path, metadata: list[tuple[str, int, bytes]], tensors: list[tuple[str, tuple, int, bytes]]):
    """Write a GGUF v3 file; metadata values and tensor data come pre-encoded; alignment 32."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, vtype, value in metadata:
        out += _string(key) + struct.pack("<I", vtype) + value
    offset = 0
    for name, shape, ggml_type, data in tensors:
        dims = tuple(reversed(shape))
        out += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", ggml_type, offset)
        offset += -(-len(data) // 32) * 32
    out += bytes(-len(out) % 32)
    for *_, data in tensors:
        out += data + bytes(-len(data) % 32)
    path.write_bytes(bytes(out))


def _q4_1_block(d: float, m: float, q: np.ndarray) -> tuple[bytes, np.ndarray]:
    q = q.astype(np.uint8)
    packed = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    d16, m16 = np.float16(d), np.float16(m)
    raw = d16.tobytes() + m16.tobytes() + packed.tobytes()
    return raw, np.float32(d16) * q.astype(np.float32) + np.float32(m16)


def _q4_0_block(d: float, q: np.ndarray) -> tuple[bytes, np.ndarray]:
    q = q.astype(np.uint8)
    d16 = np.float16(d)
    raw = d16.tobytes() + (q[:16] | (q[16:] << 4)).astype(np.uint8).tobytes()
    return raw, np.float32(d16) * (q.astype(np.float32) - 8)


def _q8_0_block(d: float, q: np.ndarray) -> tuple[bytes, np.ndarray]:
    d16 = np.float16(d)
    return d16.tobytes() + q.astype(np.int8).tobytes(), np.float32(d16) * q.astype(np.float32)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    expected: dict[str, np.ndarray] = {}
    tensors = []
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    tensors.append(("a.f32", (3, 5), 0, f32.tobytes()))
    expected["a.f32"] = f32
    f16 = rng.standard_normal((2, 4)).astype(np.float16)
    tensors.append(("b.f16", (2, 4), 1, f16.tobytes()))
    expected["b.f16"] = f16.astype(np.float32)
    bf16_bits = (rng.standard_normal(6).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    tensors.append(("c.bf16", (6,), 30, bf16_bits.tobytes()))
    expected["c.bf16"] = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
    for name, ggml_type, make in (
        ("d.q4_1", 3, lambda: _q4_1_block(rng.uniform(0.01, 1), rng.uniform(-1, 1), rng.integers(0, 16, 32))),
        ("e.q4_0", 2, lambda: _q4_0_block(rng.uniform(0.01, 1), rng.integers(0, 16, 32))),
        ("f.q8_0", 8, lambda: _q8_0_block(rng.uniform(0.01, 1), rng.integers(-128, 128, 32))),
    ):
        blocks = [make() for _ in range(4)]  # shape (2, 64): two blocks per row
        tensors.append((name, (2, 64), ggml_type, b"".join(raw for raw, _ in blocks)))
        expected[name] = np.concatenate([v for _, v in blocks]).reshape(2, 64)
    metadata = [
        ("general.architecture", 8, _string("llama")),
        ("x.u32", 4, struct.pack("<I", 7)),
        ("x.f32", 6, struct.pack("<f", 0.5)),
        ("x.bool", 7, struct.pack("<?", True)),
        ("x.u64", 10, struct.pack("<Q", 2**40)),
        ("x.strings", 9, struct.pack("<IQ", 8, 2) + _string("Ġa") + _string("b c")),
        ("x.ints", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", 1, -2, 3)),
    ]
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, metadata, tensors)
    return path, expected


def test_metadata(gguf_path):
    path, _ = gguf_path
    with GGUFFile(path) as f:
        meta = f.metadata
        assert f.version == 3
        assert meta["general.architecture"] == "llama"
        assert meta["x.u32"] == 7 and meta["x.f32"] == 0.5 and meta["x.bool"] is True and meta["x.u64"] == 2**40
        assert meta["x.strings"] == ["Ġa", "b c"]
        assert meta["x.ints"].tolist() == [1, -2, 3]


def test_tensors_decode_exactly(gguf_path):
    path, expected = gguf_path
    with GGUFFile(path) as f:
        assert list(f.tensors) == list(expected)
        for name, want in expected.items():
            got = f.read_tensor(name)
            assert got.dtype == np.float32 and got.shape == want.shape, name
            np.testing.assert_array_equal(got, want, err_msg=name)  # same float32 ops: bit-exact


def test_bad_files_raise(tmp_path, gguf_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(GGUFFormatError, match="b'GGUF'"):
        GGUFFile(bad)
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(GGUFFormatError, match="version 1"):
        GGUFFile(bad)
    # An unsupported storage type (Q6_K = 14) names the tensor and the types that are read.
    _write_gguf(bad, [], [("k.q6", (256,), 14, bytes(210))])
    with pytest.raises(GGUFFormatError, match=r"'k.q6' has ggml type 14.*Q4_1"):
        GGUFFile(bad)
    with GGUFFile(gguf_path[0]) as f, pytest.raises(KeyError, match="no tensor"):
        f.read_tensor("missing")


def test_dequantize_q4_1_nibble_order():
    # Byte j holds value j (low nibble) and value j + 16 (high nibble).
    raw = np.frombuffer(np.float16(1).tobytes() + np.float16(0).tobytes() + bytes([0x21] * 16), dtype=np.uint8)
    np.testing.assert_array_equal(dequantize(raw, 3), np.array([1.0] * 16 + [2.0] * 16, dtype=np.float32))
