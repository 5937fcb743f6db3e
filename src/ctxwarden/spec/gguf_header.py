"""Read a GGUF file's header: key/value metadata and the tensor table, with plain `struct`.

`gguf.GGUFReader` maps every tensor and builds a numpy view for every field, which took 2.5 s
(9 s under load) on SmolLM2's 98 MB file, and the planner, the tokenizer and the loader each
opened one. This reader walks the header once (0.2 s) and stops before the tensor data; the
loader then maps only the bytes of each tensor it asks for. No torch.

Layout (GGUF v2/v3, little-endian):
    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64 | kv_count x (key, type u32, value)
    key/string = u64 byte length + UTF-8 bytes; array = item type u32 + count u64 + items
    then tensor_count x (name, n_dims u32, n_dims x u64 dims, type u32, offset u64)
    then padding to `general.alignment` (default 32), then the tensor data
"""

from __future__ import annotations

import struct
from pathlib import Path
from dataclasses import dataclass
from typing import Any, BinaryIO

from ctxwarden.errors import ConfigError

# GGUF value type id -> struct format of one scalar (8 = string and 9 = array are handled apart).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file: ggml dims (fastest-varying first), type id, data offset."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int  # from the start of the data section

    @property
    def shape(self) -> tuple[int, ...]:
        """The row-major (numpy / torch) shape: ggml dims reversed."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    data_offset: int  # byte offset of the data section in the file


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value of a GGUF header, arrays as Python lists (token tables included)."""
    with open(path, "rb") as f:
        _tensor_count, kv_count = _read_preamble(f, Path(path))
        return {_read_string(f): _read_value(f) for _ in range(kv_count)}


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The metadata, the tensor table and where the tensor data starts."""
    with open(path, "rb") as f:
        tensor_count, kv_count = _read_preamble(f, Path(path))
        metadata = {_read_string(f): _read_value(f) for _ in range(kv_count)}
        tensors = tuple(_read_tensor_info(f) for _ in range(tensor_count))
        alignment = int(metadata.get("general.alignment", 32))
        data_offset = -(-f.tell() // alignment) * alignment
    return GGUFHeader(metadata, tensors, data_offset)


def _read_preamble(f: BinaryIO, path: Path) -> tuple[int, int]:
    magic = f.read(4)
    if magic != b"GGUF":
        raise ConfigError(str(path), "<magic>", f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    (version,) = struct.unpack("<I", f.read(4))
    if version < 2:
        raise ConfigError(str(path), "<version>", f"GGUF version {version} is unsupported (need 2 or 3)")
    return struct.unpack("<QQ", f.read(16))


def _read_tensor_info(f: BinaryIO) -> GGUFTensorInfo:
    name = _read_string(f)
    (n_dims,) = struct.unpack("<I", f.read(4))
    dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
    type_id, offset = struct.unpack("<IQ", f.read(12))
    return GGUFTensorInfo(name, tuple(int(d) for d in dims), type_id, offset)


def _read_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO) -> Any:
    (vtype,) = struct.unpack("<I", f.read(4))
    if vtype == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        return _read_array(f, item_type, count)
    return _read_scalar(f, vtype)


def _read_scalar(f: BinaryIO, vtype: int) -> Any:
    if vtype == _STRING:
        return _read_string(f)
    fmt = _SCALAR_FORMATS.get(vtype)
    if fmt is None:
        raise ConfigError(getattr(f, "name", "<gguf>"), "<value type>", f"unknown GGUF value type {vtype}")
    (value,) = struct.unpack(fmt, f.read(struct.calcsize(fmt)))
    return value


def _read_array(f: BinaryIO, item_type: int, count: int) -> list[Any]:
    fmt = _SCALAR_FORMATS.get(item_type)
    if fmt is not None:  # fixed-size items: one unpack for the whole array
        size = struct.calcsize(fmt)
        return list(struct.unpack(f"<{count}{fmt[1]}", f.read(size * count)))
    return [_read_value_of_type(f, item_type) for _ in range(count)]


def _read_value_of_type(f: BinaryIO, vtype: int) -> Any:
    if vtype == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        return _read_array(f, item_type, count)
    return _read_scalar(f, vtype)
