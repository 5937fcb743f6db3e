"""Read a GGUF file's key/value metadata (tokenizer tables included) without reading tensors.

`gguf.GGUFReader` maps every tensor and builds a view for every field, which takes seconds on
a 100 MB file; the tokenizer only needs the header's key/value table, which sits at the front.
This reader walks that table once with `struct` and stops before the tensor infos.

Layout (GGUF v2/v3, little-endian):
    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64 | kv_count x (key, type u32, value)
    key/string = u64 byte length + UTF-8 bytes; array = item type u32 + count u64 + items
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from ctxwarden.errors import ConfigError

# GGUF value type id -> struct format of one scalar (8 = string and 9 = array are handled apart).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value of a GGUF header, arrays as Python lists (token tables included)."""
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise ConfigError(str(path), "<magic>", f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        (version,) = struct.unpack("<I", f.read(4))
        if version < 2:
            raise ConfigError(str(path), "<version>", f"GGUF version {version} is unsupported (need 2 or 3)")
        _tensor_count, kv_count = struct.unpack("<QQ", f.read(16))
        return {_read_string(f): _read_value(f) for _ in range(kv_count)}


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
