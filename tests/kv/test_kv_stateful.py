"""Stateful property test: random allocate / append / share / free / preempt / evict steps.

After every step the machine checks, against the manager and a shadow model of block
contents it keeps itself:
- the audit is clean (identity, ownership, ref counts, free lists) with the machine's own
  list of live sequences, so a block kept by a freed sequence would be a leak finding;
- no two namespaces hold a common block, and the cross-namespace counter is 0;
- every prefix hit shares blocks whose content (namespace, group, whole prefix of tokens)
  is exactly the prompt's: a wrong hit would read another prompt's KV;
- each sequence holds at most group_blocks_needed(...) blocks per group for the largest
  chunk it was given: the planner's admission numbers hold at run time.
"""

from kv_layouts import hybrid_layout, sink_layout, uniform_layout
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ctxwarden.errors import DoubleFree, KVPoolExhausted, UseAfterFree
from ctxwarden.kv import KVCacheManager
from ctxwarden.plan.kv import group_blocks_needed

NAMESPACES = ("tenant-a", "tenant-b")
FAMILIES = tuple(tuple(range(base, base + 24)) for base in (0, 100, 200))


class KVMachine(RuleBasedStateMachine):
    layout = uniform_layout(4)
    num_blocks = 24

    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(self.layout, self.num_blocks)
        self.bs = self.layout.block_size
        self.tokens: dict[int, list[int]] = {}  # known tokens per live sequence
        self.namespace: dict[int, str] = {}
        self.max_chunk: dict[int, int] = {}
        self.freed: set[int] = set()
        self.content: dict[int, tuple] = {}  # block id -> (namespace, group, prefix tokens)
        self.next_id = 0

    # --- rules ----------------------------------------------------------------------------

    @rule(ns=st.sampled_from(NAMESPACES), family=st.sampled_from(FAMILIES),
          prefix_tokens=st.integers(0, 24), suffix=st.lists(st.integers(0, 3), max_size=10),
          chunk=st.one_of(st.none(), st.integers(1, 12)))
    def allocate(self, ns, family, prefix_tokens, suffix, chunk):
        self._allocate(list(family[:prefix_tokens]) + suffix, ns, chunk)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=6))
    def share(self, data, extra):
        """A new prompt that extends a live sequence's tokens: the prefix-hit path."""
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        cut = data.draw(st.integers(0, len(self.tokens[src])))
        self._allocate(self.tokens[src][:cut] + extra, self.namespace[src], None)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), num_new=st.integers(1, 7))
    def append(self, data, num_new):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        pending = len(self.tokens[seq]) - self.m.num_tokens(seq)
        new_ids = [] if pending else [(seq + i) % 5 for i in range(num_new)]
        num_new = min(num_new, pending) if pending else num_new
        before = self.m.num_tokens(seq)
        if not self.m.can_append(seq, num_new):
            with_error(KVPoolExhausted, self.m.append, seq, new_ids, num_new)
            assert self.m.num_tokens(seq) == before
            return
        self.m.append(seq, new_ids, num_new)
        self.tokens[seq] += new_ids
        self.max_chunk[seq] = max(self.max_chunk[seq], num_new)
        self._record_contents()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(seq)
        self._forget(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def abort_a_step(self, data):
        """The runner failed: only num_computed tokens were written; the rest is garbage."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        computed = data.draw(st.integers(0, self.m.num_tokens(seq)))
        for table in self.m.block_tables(seq):
            for b in table[computed // self.bs:]:
                if b is not None and self.m.pool.ref_count(b) == 1:
                    self.content.pop(b, None)  # a hit on it would now fail the check
        self.m.free(seq, num_computed_tokens=computed)
        self._forget(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt_and_recompute(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens, ns = self.tokens[seq], self.namespace[seq]
        self.m.free(seq)
        self._forget(seq)
        self._allocate(tokens, ns, None, seq_id=seq)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def misuse_a_freed_sequence(self, data):
        seq = data.draw(st.sampled_from(sorted(self.freed)))
        with_error(DoubleFree, self.m.free, seq)
        with_error(UseAfterFree, self.m.append, seq, [1])

    @rule(num_tokens=st.integers(1, 60))
    def evict_by_pressure(self, num_tokens):
        """A burst that takes whatever it can (evicting cached blocks), then leaves."""
        self._allocate([9] * num_tokens, NAMESPACES[0], None)
        seq = self.next_id - 1
        if seq in self.tokens:
            self.m.free(seq)
            self._forget(seq)

    # --- helpers --------------------------------------------------------------------------

    def _allocate(self, prompt, ns, chunk, seq_id=None):
        prompt = prompt or [7]
        seq = self.next_id if seq_id is None else seq_id
        self.next_id += seq_id is None
        if not self.m.can_allocate(prompt, ns, max_num_new_tokens=chunk):
            with_error(KVPoolExhausted, self.m.allocate, seq, prompt, ns, (), chunk)
            return
        alloc = self.m.allocate(seq, prompt, ns, max_num_new_tokens=chunk)
        assert alloc.num_computed_tokens % self.bs == 0
        assert alloc.num_computed_tokens <= len(prompt) - 1
        self._check_hit_content(seq, prompt, ns, alloc.num_computed_tokens)
        self.tokens[seq], self.namespace[seq] = list(prompt), ns
        self.max_chunk[seq] = alloc.num_new_tokens
        self.freed.discard(seq)
        self._record_contents()

    def _check_hit_content(self, seq, prompt, ns, num_hit_tokens):
        for g, table in enumerate(self.m.block_tables(seq)):
            for j, b in enumerate(table[:num_hit_tokens // self.bs]):
                if b is not None:
                    assert self.content[b] == (ns, g, tuple(prompt[:(j + 1) * self.bs]))

    def _forget(self, seq):
        for d in (self.tokens, self.namespace, self.max_chunk):
            del d[seq]
        self.freed.add(seq)

    # --- invariants -----------------------------------------------------------------------

    @invariant()
    def books_balance(self):
        report = self.m.audit(live_seq_ids=list(self.tokens))
        assert report.is_clean, report.findings
        stats = self.m.stats(run_audit_check=False)
        assert (stats.num_blocks_free + stats.num_blocks_cached + stats.num_blocks_in_use
                == stats.num_blocks_total)
        assert stats.num_cross_namespace_hits == 0

    @invariant()
    def namespaces_share_nothing(self):
        held = {ns: set() for ns in NAMESPACES}
        for seq, ns in self.namespace.items():
            held[ns].update(b for t in self.m.block_tables(seq) for b in t if b is not None)
        assert not held[NAMESPACES[0]] & held[NAMESPACES[1]]

    @invariant()
    def within_the_planner_bound(self):
        lay = self.layout
        for seq in self.tokens:
            n = self.m.num_tokens(seq)
            for group, table in zip(lay.groups, self.m.block_tables(seq)):
                assert sum(b is not None for b in table) <= group_blocks_needed(
                    n, lay.block_size, group.window_tokens, lay.sink_tokens, self.max_chunk[seq])

    def _record_contents(self):
        """Shadow model: what each physical block now holds (full blocks only)."""
        for seq, tokens in self.tokens.items():
            n = self.m.num_tokens(seq)
            for g, table in enumerate(self.m.block_tables(seq)):
                for j, b in enumerate(table):
                    if b is None:
                        continue
                    full = (j + 1) * self.bs <= n
                    self.content[b] = (self.namespace[seq], g, tuple(tokens[:(j + 1) * self.bs]))
                    if not full:
                        self.content.pop(b)


def with_error(error, fn, *args):
    try:
        fn(*args)
    except error:
        return
    raise AssertionError(f"{fn.__name__}{args} did not raise {error.__name__}")


class HybridMachine(KVMachine):
    layout = hybrid_layout(4, 8)
    num_blocks = 30


class SinkMachine(KVMachine):
    layout = sink_layout(4, 10, 3)
    num_blocks = 20


SETTINGS = settings(max_examples=80, stateful_step_count=50, deadline=None)
TestUniform = KVMachine.TestCase
TestUniform.settings = SETTINGS
TestHybrid = HybridMachine.TestCase
TestHybrid.settings = SETTINGS
TestSink = SinkMachine.TestCase
TestSink.settings = SETTINGS
