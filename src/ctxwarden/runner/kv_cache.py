"""The paged KV pool: one set of K/V tensors per layer slot of a group, allocated once.

    layout.groups:  g0 = layers (0, 2, 4)   g1 = layers (1, 3, 5)     layers_per_group = 3
    tensors:        pair 0 serves layers 0 and 1, pair 1 layers 2 and 3, pair 2 layers 4, 5
    each tensor:    [num_blocks, block_size, num_kv_heads, head_dim]
                    fp8: uint8 [..., head_dim + 1], float8 codes + a scale byte (kv_quant.py)

A block id is a page of the one pool: in group g it holds block_size tokens of every layer
of g (one row of each tensor pair). Two groups never hold the same block id at the same
time (the block manager's job), so groups sharing tensor pairs never overwrite each other.
Total bytes = num_blocks * layout.page_bytes, exactly the planner's kv_pool_bytes.

MLA (DeepSeek-V2/V3) caches one "head" per token, [latent | rotated rope key]; the value is
the latent, a prefix of the same row, so `values_share_keys` makes each layer's value tensor
the key tensor itself (allocated once; attention reads the whole row as the value and the
model keeps the latent part of the output).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ctxwarden.plan.kv import KVLayout, kv_row_bytes
from ctxwarden.runner.host_malloc import libc
from ctxwarden.runner.kv_quant import FP8_TORCH_DTYPES, quantize_rows
from ctxwarden.spec.dtypes import DTYPES, canonical_dtype

# What this runner can store: fp8 as float8 codes with a scale byte per row (kv_quant.py).
STORABLE_KV_DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")


def kv_torch_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype of a KV dtype name this runner can allocate (ValueError otherwise);
    fp8 pools hold bytes (uint8): codes and scales side by side."""
    name = canonical_dtype(kv_dtype, STORABLE_KV_DTYPES, "kv dtype")
    return torch.uint8 if name in FP8_TORCH_DTYPES else getattr(torch, DTYPES[name].torch_name)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros whose pages the OS hands out on first touch: RSS tracks use, not pool size.

    torch.zeros writes every byte (a 2 GiB pool is 2 GiB of RSS at start-up). Each CPU
    tensor is its own anonymous mapping, whose pages are zero until first written, at
    4 KiB: the pool's RSS is the pages its used blocks cover. Two ways of getting zeros
    from the heap missed that, both measured on SmolLM2's W2 (one 8,000-token prompt, 60
    pool tensors of 8.5 MiB, 2026-12-07): numpy's zeros (calloc) asks for transparent huge
    pages on every array of 4 MiB or more, so each tensor's first write past a 2 MiB
    boundary made 2 MiB resident (60 MiB more than the 176 MiB of used blocks); and calloc
    from memory the heap already held (the load's freed temporaries) clears it, making
    the whole tensor resident at start-up. Huge pages are refused here for the same reason
    (where the kernel's policy is `always`). Zeros rather than empty: masked-out padding
    of a batched decode still multiplies its values by 0, and recycled memory could hold NaN.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    width = torch.empty((), dtype=dtype).element_size()
    nbytes = width * math.prod(shape)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes)  # private, anonymous: unmapped when the tensor is freed
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def _resident_bytes(t: torch.Tensor) -> int | None:
    """Bytes of the pages spanning CPU tensor `t` that are resident (mincore(2)); None where
    mincore is not there (not Linux) or `t` is on a device."""
    lib = libc() if sys.platform.startswith("linux") else None
    if t.device.type != "cpu" or lib is None:
        return None
    if t.nbytes == 0:
        return 0
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    count = -(-(t.data_ptr() + t.nbytes - start) // page)
    vec = (ctypes.c_ubyte * count)()
    if lib.mincore(ctypes.c_void_p(start), ctypes.c_size_t(count * page), vec) != 0:
        return None
    return sum(v & 1 for v in vec) * page


@dataclass(frozen=True)
class LayerKV:
    """One layer's view of the pool: its tensor pair and its group's window rules."""

    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim] (fp8: uint8 rows)
    value: torch.Tensor
    group_index: int
    window_tokens: int | None
    sink_tokens: int
    fp8_dtype: torch.dtype | None = None  # the codes' format when the pool holds fp8 rows


@dataclass(frozen=True)
class PageCopy:
    """A copy of one page's contents (every tensor pair's row), e.g. for swap to host."""

    keys: tuple[torch.Tensor, ...]  # layers_per_group x [block_size, num_kv_heads, head_dim]
    values: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)


class PagedKVCache:
    """K/V tensors for `num_blocks` pages of `layout`, allocated once, touched as used."""

    def __init__(self, layout: KVLayout, num_blocks: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: str = "fp32", device: str | torch.device = "cpu",
                 values_share_keys: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}; give the KV pool "
                             "more memory or lower the block size")
        self.layout, self.num_blocks = layout, num_blocks
        self.block_size = layout.block_size
        dtype = kv_torch_dtype(kv_dtype)
        self.fp8_dtype = FP8_TORCH_DTYPES.get(canonical_dtype(kv_dtype, STORABLE_KV_DTYPES))
        row = head_dim if self.fp8_dtype is None else kv_row_bytes(head_dim, kv_dtype)
        shape = (num_blocks, layout.block_size, num_kv_heads, row)
        self.keys = [_lazy_zeros(shape, dtype, device) for _ in range(layout.layers_per_group)]
        self.values = (self.keys if values_share_keys else
                       [_lazy_zeros(shape, dtype, device) for _ in range(layout.layers_per_group)])
        self.values_share_keys = values_share_keys
        self._layers: dict[int, LayerKV] = {}
        self._slot_of_layer = {layer: (g_index, j)
                               for g_index, g in enumerate(layout.groups)
                               for j, layer in enumerate(g.layer_ids)}

    @property
    def nbytes(self) -> int:
        """Bytes of every KV tensor allocated (equals num_blocks * layout.page_bytes)."""
        return sum(t.nbytes for t in self._tensors())

    def resident_bytes(self) -> int | None:
        """Bytes of the pool the OS holds in memory now (mincore over each tensor's pages):
        the pages written so far, not the pool's size. None where it cannot be asked (not
        Linux, or a device pool)."""
        sizes = [_resident_bytes(t) for t in self._tensors()]
        return None if None in sizes else sum(sizes)

    def _tensors(self) -> list[torch.Tensor]:
        """Every distinct pool tensor, in page order: per layer slot its keys, then values."""
        if self.values_share_keys:
            return list(self.keys)
        return [t for pair in zip(self.keys, self.values) for t in pair]

    def layer(self, layer_id: int) -> LayerKV:
        """The tensor pair and window rules of model layer `layer_id` (built once: a decode
        step asks for each layer's twice, and the pool's tensors never change)."""
        found = self._layers.get(layer_id)
        if found is not None:
            return found
        g_index, j = self._slot_of_layer[layer_id]
        group = self.layout.groups[g_index]
        sinks = self.layout.sink_tokens if group.window_tokens else 0
        found = self._layers[layer_id] = LayerKV(self.keys[j], self.values[j], g_index,
                                                 group.window_tokens, sinks, self.fp8_dtype)
        return found

    def write(self, layer: LayerKV, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store new tokens' key/value [T, kv_heads, head_dim] at flat slots [T]."""
        flat_k = layer.key.view(-1, *layer.key.shape[2:])
        if layer.fp8_dtype is not None:
            key = quantize_rows(key, layer.fp8_dtype)
            if layer.value is not layer.key:
                value = quantize_rows(value, layer.fp8_dtype)
        flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
        if layer.value is layer.key:  # MLA: the value is part of the row just written
            return
        flat_v = layer.value.view(-1, *layer.value.shape[2:])
        flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))

    @property
    def page_shape(self) -> tuple[int, ...]:
        """The shape of one page as bytes are laid out by `read_pages`: [layers, 2 (K, V), block,
        heads, dim]; [layers, 1, ...] when values share the keys (MLA)."""
        return (len(self.keys), 1 if self.values_share_keys else 2) + tuple(self.keys[0].shape[1:])

    def read_pages(self, block_ids: Sequence[int]) -> np.ndarray:
        """Copy pages out of the pool as bytes: uint8 [len(block_ids), page bytes].

        Row i is page block_ids[i]: for each layer slot its keys then its values (the layout
        `page_shape` names), so one row is exactly what a KV tier stores for one block.
        """
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        out = torch.empty((len(idx),) + self.page_shape, dtype=self.keys[0].dtype)
        flat = out.view(len(idx), -1, *self.page_shape[2:])  # [n, layers * parts, block, ...]
        for j, t in enumerate(self._tensors()):
            flat[:, j] = t.index_select(0, idx)
        return out.view(torch.uint8).reshape(len(idx), -1).numpy()

    def write_pages(self, block_ids: Sequence[int], pages: Sequence) -> None:
        """Write byte pages (as `read_pages` lays them out) into pool pages `block_ids`."""
        n = len(block_ids)
        page_bytes = self.nbytes // self.num_blocks
        buf = np.empty((n, page_bytes), dtype=np.uint8)
        for i, page in enumerate(pages):
            buf[i] = np.frombuffer(page, dtype=np.uint8)  # raises if a page has the wrong size
        data = torch.from_numpy(buf).view(self.keys[0].dtype).view(n, -1, *self.page_shape[2:])
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        for j, t in enumerate(self._tensors()):
            t.index_copy_(0, idx, data[:, j])

    def read_page(self, block_id: int) -> PageCopy:
        """Copy page `block_id` out of the pool (the page itself is left as it is)."""
        values = () if self.values_share_keys else tuple(v[block_id].clone() for v in self.values)
        return PageCopy(tuple(k[block_id].clone() for k in self.keys), values)

    def write_page(self, block_id: int, page: PageCopy) -> None:
        """Overwrite page `block_id` with a copy taken by `read_page`."""
        if len(page.keys) != len(self.keys):
            raise ValueError(f"page copy holds {len(page.keys)} layers, the pool has {len(self.keys)} per page")
        values = [] if self.values_share_keys else self.values
        for dst, src in zip(self.keys + values, page.keys + page.values):
            dst[block_id].copy_(src)
