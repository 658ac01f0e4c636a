"""Read a GGUF file (llama.cpp's container): header, metadata, tensor table, and dequantised tensors.

Layout of a GGUF v2/v3 file, all little-endian:

- header: ``b"GGUF"``, uint32 version, uint64 tensor count, uint64 metadata count;
- metadata: (string key, uint32 value type, value) per entry; a string is uint64 length + UTF-8
  bytes, an array is uint32 element type + uint64 count + elements;
- tensor table: (string name, uint32 n_dims, uint64 dims[n_dims], uint32 ggml type, uint64 offset)
  per tensor, where ``dims[0]`` is the fastest-varying axis (so the row-major shape is the reverse)
  and the offset counts from the start of the data section;
- data section: starts at the next multiple of ``general.alignment`` (default 32) after the table.

Only the ggml storage types a small llama checkpoint uses are decoded: F32, F16, BF16, Q8_0, Q4_0
and Q4_1 (blocks of 32 values with one or two float16 block constants). Anything else raises.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringtune.errors import UserInputError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types: type id -> struct format of one scalar (STRING = 8, ARRAY = 9 are handled apart).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# ggml storage types this reader decodes: type id -> (name, values per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 2 + 16),
    3: ("Q4_1", 32, 2 + 2 + 16),
    8: ("Q8_0", 32, 2 + 32),
    30: ("BF16", 1, 2),
}


class GGUFFormatError(UserInputError):
    """A file that is not a GGUF file this reader understands (bad magic, version or tensor type)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table.

    ``shape`` is row-major (the reverse of GGUF's ``dims``); ``offset`` is absolute in the file;
    ``nbytes`` is the size of the stored (possibly quantised) data.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]


class _Cursor:
    """Sequential little-endian reads over a buffer."""

    def __init__(self, buf: memoryview | bytes | mmap.mmap, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.scalar("<I")
            count = self.scalar("<Q")
            if etype in _SCALAR_FORMATS and etype != 7:
                # Numeric arrays in one go (token types, scores): a numpy array.
                dtype = np.dtype(_SCALAR_FORMATS[etype])
                out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += dtype.itemsize * count
                return out
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALAR_FORMATS:
            raise GGUFFormatError(f"GGUF metadata value type {vtype} at byte {self.pos} is not one of 0..12")
        return self.scalar(_SCALAR_FORMATS[vtype])


class GGUFFile:
    """A GGUF file opened read-only and memory-mapped; use as a context manager.

    ``metadata`` maps each key to a Python scalar, a string, a list (string arrays) or a numpy array
    (numeric arrays). ``tensors`` maps each tensor name to its :class:`GGUFTensorInfo`, in file order.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as file:  # the map keeps its own handle on the file
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except Exception:
            self.close()
            raise

    def _parse(self) -> None:
        if self._map[:4] != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path}: first 4 bytes are {self._map[:4]!r}, a GGUF file starts with b'GGUF'")
        cur = _Cursor(self._map, 4)
        self.version: int = cur.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {self.version}; this reader reads versions 2 and 3")
        n_tensors = cur.scalar("<Q")
        n_kv = cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            raw_infos.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, rel_offset in raw_infos:
            if ggml_type not in GGML_TYPES:
                known = ", ".join(f"{k}={v[0]}" for k, v in GGML_TYPES.items())
                raise GGUFFormatError(
                    f"{self.path}: tensor {name!r} has ggml type {ggml_type}; this reader decodes {known}"
                )
            _, block, block_bytes = GGML_TYPES[ggml_type]
            numel = int(np.prod(shape, dtype=np.int64))
            if numel % block:
                raise GGUFFormatError(f"{self.path}: tensor {name!r} has {numel} values, not a multiple of {block}")
            nbytes = numel // block * block_bytes
            offset = data_start + rel_offset
            if offset + nbytes > len(self._map):
                raise GGUFFormatError(
                    f"{self.path}: tensor {name!r} ends at byte {offset + nbytes}, past the file end {len(self._map)}"
                )
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, offset, nbytes)

    def read_tensor(self, name: str) -> np.ndarray:
        """Return tensor ``name`` dequantised to a new float32 numpy array of its row-major shape."""
        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {name!r} (the file has {len(self.tensors)} tensors)")
        info = self.tensors[name]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return dequantize(raw, info.ggml_type).reshape(info.shape)

    def close(self) -> None:
        if not self._map.closed:
            self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def dequantize(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Decode the uint8 bytes of one tensor stored as ``ggml_type`` into a flat float32 array.

    Block formats (32 values per block, float16 constants first, then packed quants):
      Q8_0: d, int8 q[32]          -> d * q
      Q4_0: d, uint8 qs[16]        -> d * (nibble - 8)
      Q4_1: d, m, uint8 qs[16]     -> d * nibble + m
    where byte j of ``qs`` holds value j in its low nibble and value j + 16 in its high nibble.
    """
    name = GGML_TYPES[ggml_type][0]
    if name == "F32":
        return raw.view("<f4").astype(np.float32)
    if name == "F16":
        return raw.view("<f2").astype(np.float32)
    if name == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    _, _, block_bytes = GGML_TYPES[ggml_type]
    blocks = raw.reshape(-1, block_bytes)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)  # [n_blocks, 1]
    if name == "Q8_0":
        return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    qs = blocks[:, -16:]
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # [n_blocks, 32]
    if name == "Q4_0":
        return (d * (nibbles - 8.0)).reshape(-1)
    m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
    return (d * nibbles + m).reshape(-1)  # Q4_1
