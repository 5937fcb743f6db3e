"""KVStats: every number, exact, on a hand-written scenario; fragmentation definitions."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from kv_layouts import hybrid_layout, uniform_layout

from ctxwarden.kv import KVCacheManager
from ctxwarden.kv.stats import largest_run

KV_SRC = Path(__file__).resolve().parents[2] / "src" / "ctxwarden" / "kv"


def test_stats_expose_every_number():
    m = KVCacheManager(uniform_layout(4), 12)
    m.allocate("a", list(range(10)))  # blocks 0 1 2, block 2 holds 2 of 4
    m.allocate("b", list(range(9)))  # hits 0 1 (8 tokens), new block 3 holds 1
    m.allocate("c", [5, 5, 5, 5, 5])  # blocks 4 5
    m.free("c")  # 4 evictable (full), 5 free
    s = m.stats()
    assert (s.num_blocks_total, s.num_blocks_in_use, s.num_blocks_cached, s.num_blocks_free) == \
        (12, 4, 1, 7)
    assert (s.num_prefix_queries, s.num_prefix_query_tokens, s.num_prefix_hit_tokens) == (3, 24, 8)
    assert s.prefix_hit_rate == 8 / 24
    assert (s.num_evictions, s.num_cross_namespace_hits, s.num_sequences) == (0, 0, 2)
    frag = s.fragmentation
    assert (frag.num_allocated_slots, frag.num_wasted_slots) == (16, 2 + 3)
    assert frag.internal_waste == 5 / 16
    assert (frag.num_allocatable_blocks, frag.largest_free_run_blocks) == (8, 8)
    assert frag.external_fragmentation == 0.0
    assert s.audit_findings == ()
    json.dumps(s.to_dict())  # the dict is JSON-ready


def test_external_fragmentation_counts_holes_between_in_use_blocks():
    m = KVCacheManager(uniform_layout(1), 8)
    for i in range(8):
        m.allocate(i, [i])
    for i in (1, 3, 4, 6):
        m.free(i)
    frag = m.stats().fragmentation  # allocatable: 1 | 3 4 | 6 -> largest run 2 of 4
    assert (frag.num_allocatable_blocks, frag.largest_free_run_blocks) == (4, 2)
    assert frag.external_fragmentation == 0.5


def test_internal_waste_counts_every_group():
    m = KVCacheManager(hybrid_layout(4, 8), 20)
    m.allocate("a", list(range(5)))  # 2 blocks per group, 3 empty slots in each last block
    frag = m.stats().fragmentation
    assert (frag.num_allocated_slots, frag.num_wasted_slots) == (16, 6)


def test_largest_run():
    assert largest_run([]) == 0
    assert largest_run([True, False, True, True, False]) == 2


def test_kv_package_imports_without_torch():
    code = "import sys, ctxwarden.kv; assert 'torch' not in sys.modules, 'torch imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_kv_functions_stay_under_50_lines():
    for path in KV_SRC.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 50, f"{path.name}:{node.name} is {length} lines"
