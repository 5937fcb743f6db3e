"""Long-document QA under a budget: hard truncation vs keep-tail-semantic.

A generated set from /work/shared/corpora: real text excerpts 2-8x the prompt budget, with
facts planted at several depths ("The ledger number of the Harwick estate is 4821.") and a
question about one of them at the end. Each strategy fits the prompt into the same budget;
we report how often the question survives, how often the answer-bearing sentence survives
(evidence recall), and both, by depth and by overflow ratio.

    python benchmarks/context_quality.py [--docs 60] [--window 2048] [--max-tokens 256]

The fitter never sees the answer: keep-tail-semantic ranks sentences by the question's
words only, so a planted fact survives when the question names it and the budget has room.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import Counter
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ctxwarden.context import fit, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CORPORA = ROOT.parent / "shared" / "corpora"
if not CORPORA.is_dir():
    CORPORA = Path("/work/shared/corpora")
STRATEGIES = ("truncate-head", "truncate-middle", "truncate-tail", "keep-tail-semantic")
DEPTHS = (0.1, 0.35, 0.6, 0.85)
RATIOS = (2, 3, 4, 6, 8)
ATTRIBUTES = ["ledger number", "gate colour", "vault code", "harvest weight", "signal phrase", "room number",
              "ferry time", "password", "boundary stone count", "bell pitch", "orchard row", "lamp colour"]
ENTITIES = ["the Harwick estate", "Captain Merrow", "the Linden archive", "Mrs. Aldous Fenn", "the Quarry Mill",
            "Doctor Ilse Varga", "the north lighthouse", "the Bramwell school", "Mr. Tobias Crane",
            "the Wexley chapel", "the river warden", "the Ormond library"]
COLOURS = ["cobalt blue", "saffron", "olive green", "crimson", "pale grey", "amber", "violet"]
# The paraphrase set: the fact and the question share only the entity's name, and every
# planted fact names the same entity, a frequent name in the excerpt (so the name alone
# does not single the fact out). (fact predicate, question about it)
PARAPHRASES = [("keeps the strongroom combination {n}", "What number opens {e}'s vault?"),
               ("booked a passage departing at {n} o'clock", "At what hour does {e}'s boat leave?"),
               ("was assigned locker {n} at the station", "Where does {e} store luggage? Give the number."),
               ("chose the watchword {n}", "Which secret word unlocks {e}'s account?"),
               ("planted {n} apple saplings last spring", "How many trees did {e} put in the orchard?"),
               ("paid {n} guineas for the grey mare", "What did {e} spend on a horse?")]
_NAME_RE = re.compile(r"\b(?:Mr|Mrs|Miss|Captain|Colonel|Lady|Sir)\.? [A-Z][a-z]+")


@dataclass(frozen=True)
class Case:
    doc_id: int
    kind: str  # "lexical" (question repeats the fact's words) or "paraphrase"
    ratio: int
    asked_depth: float
    text: str
    question: str
    evidence: str


@dataclass(frozen=True)
class Outcome:
    doc_id: int
    kind: str
    strategy: str
    ratio: int
    asked_depth: float
    question_kept: bool
    evidence_kept: bool
    prompt_tokens: int


def _fact(rng: random.Random, entity: str, attribute: str) -> str:
    value = rng.choice(COLOURS) if "colour" in attribute else str(rng.randint(1000, 9999))
    return f"The {attribute} of {entity} is {value}."


def _excerpt(rng: random.Random, sources: list[str], tok, num_tokens: int) -> str:
    """A contiguous excerpt of about num_tokens tokens, starting at a paragraph."""
    src = rng.choice(sources)
    approx_chars = num_tokens * 4
    start = src.find("\n\n", rng.randrange(0, max(1, len(src) - approx_chars * 2))) + 2
    piece = src[start:start + approx_chars * 2]
    cuts = tok.cuts(piece)
    k = min(len(cuts.cut_chars) - 1, num_tokens)
    return piece[: int(cuts.cut_chars[k])]


def _plant(rng: random.Random, doc: str, facts: list[str]) -> str:
    """Insert each fact as its own paragraph at its depth (at the nearest paragraph break)."""
    out, last = [], 0
    for depth, fact in zip(DEPTHS, facts):
        at = doc.find("\n\n", int(len(doc) * depth))
        at = int(len(doc) * depth) if at < 0 else at
        out.append(doc[last:at])
        out.append(f"\n\n{fact}")
        last = at
    out.append(doc[last:])
    return "".join(out)


def _frequent_name(rng: random.Random, doc: str) -> str:
    names = Counter(_NAME_RE.findall(doc)).most_common(3)
    return rng.choice(names)[0] if names else rng.choice(ENTITIES)


def _lexical_case(rng: random.Random, doc: str) -> tuple[list[str], int, str]:
    attrs, ents = rng.sample(ATTRIBUTES, len(DEPTHS)), rng.sample(ENTITIES, len(DEPTHS))
    facts = [_fact(rng, e, a) for e, a in zip(ents, attrs)]
    asked = rng.randrange(len(DEPTHS))
    return facts, asked, f"\n\nQuestion: What is the {attrs[asked]} of {ents[asked]}?"


def _paraphrase_case(rng: random.Random, doc: str) -> tuple[list[str], int, str]:
    entity = _frequent_name(rng, doc)
    pairs = rng.sample(PARAPHRASES, len(DEPTHS))
    facts = [f"{entity} {fact.format(n=rng.randint(10, 999))}." for fact, _ in pairs]
    asked = rng.randrange(len(DEPTHS))
    return facts, asked, "\n\nQuestion: " + pairs[asked][1].format(e=entity)


def make_cases(num_docs: int, budget_tokens: int, tok, seed: int = 1234) -> list[Case]:
    """num_docs lexical cases and num_docs paraphrase cases (same excerpts, same depths)."""
    rng = random.Random(seed)
    sources = [p.read_text() for p in sorted((CORPORA / "austen").glob("*.txt"))]
    sources.append((CORPORA / "python-docs.rst").read_text())
    cases = []
    for i in range(num_docs):
        ratio = RATIOS[i % len(RATIOS)]
        excerpt = _excerpt(rng, sources, tok, ratio * budget_tokens)
        for kind, make in (("lexical", _lexical_case), ("paraphrase", _paraphrase_case)):
            facts, asked, question = make(rng, excerpt)
            doc = _plant(rng, excerpt, facts)
            cases.append(Case(i, kind, ratio, DEPTHS[asked], doc + question, question, facts[asked]))
    return cases


def run_case(case: Case, strategy: str, window: int, max_tokens: int, tok) -> Outcome:
    r = fit(case.text, window, max_tokens, tok, strategy)
    return Outcome(case.doc_id, case.kind, strategy, case.ratio, case.asked_depth, r.text.endswith(case.question),
                   case.evidence in r.text, r.prompt_tokens)


def summarise(outcomes: list[Outcome]) -> dict:
    """Per set (lexical, paraphrase) and strategy: question / evidence / both kept, by depth and ratio."""
    def rate(items, attr):
        return round(100.0 * sum(getattr(o, attr) for o in items) / max(len(items), 1), 1)

    out: dict = {}
    for kind in ("lexical", "paraphrase"):
        for s in STRATEGIES:
            mine = [o for o in outcomes if o.strategy == s and o.kind == kind]
            both = [o for o in mine if o.question_kept and o.evidence_kept]
            out.setdefault(kind, {})[s] = {
                "question_kept_pct": rate(mine, "question_kept"), "evidence_kept_pct": rate(mine, "evidence_kept"),
                "both_kept_pct": round(100.0 * len(both) / max(len(mine), 1), 1),
                "evidence_by_depth_pct": {str(d): rate([o for o in mine if o.asked_depth == d], "evidence_kept")
                                          for d in DEPTHS},
                "evidence_by_ratio_pct": {str(x): rate([o for o in mine if o.ratio == x], "evidence_kept")
                                          for x in RATIOS}}
    return out


def plot(summary: dict, path: Path) -> None:
    """Evidence kept by depth and by overflow ratio, one row per question set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey=True)
    for row_axes, (kind, by_strategy) in zip(axes, summary.items()):
        for s, row in by_strategy.items():
            row_axes[0].plot(DEPTHS, [row["evidence_by_depth_pct"][str(d)] for d in DEPTHS], marker="o", label=s)
            row_axes[1].plot(RATIOS, [row["evidence_by_ratio_pct"][str(x)] for x in RATIOS], marker="o", label=s)
        row_axes[0].set_xlabel(f"{kind}: depth of the answer-bearing sentence")
        row_axes[1].set_xlabel(f"{kind}: document tokens / budget")
        for ax in row_axes:
            ax.set_ylabel("evidence kept (%)")
            ax.set_ylim(-3, 103)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Long-document QA: does the answer-bearing sentence survive fitting?")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=60, help="excerpts; each gives a lexical and a paraphrase case")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tokenizer", default=None, help="default: the default model's (SmolLM2)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    tok = load_tokenizer(args.tokenizer)
    budget = args.window - args.max_tokens
    cases = make_cases(args.docs, budget, tok)
    t0 = time.perf_counter()
    outcomes = [run_case(c, s, args.window, args.max_tokens, tok) for c in cases for s in STRATEGIES]
    seconds = time.perf_counter() - t0
    assert all(o.prompt_tokens <= budget for o in outcomes)
    summary = summarise(outcomes)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"docs": args.docs, "window": args.window, "max_tokens": args.max_tokens, "tokenizer": tok.name,
            "depths": DEPTHS, "ratios": RATIOS, "seconds_all_fits": round(seconds, 2)}
    (args.out / "context_quality.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "outcomes": [asdict(o) for o in outcomes]}, indent=2))
    plot(summary, args.out / "context_quality.png")
    print("| set | strategy | question kept | evidence kept | both |\n|---|---|---|---|---|")
    for kind, by_strategy in summary.items():
        for s, row in by_strategy.items():
            print(f"| {kind} | {s} | {row['question_kept_pct']}% | {row['evidence_kept_pct']}% | "
                  f"{row['both_kept_pct']}% |")
    print(f"{len(outcomes)} fits in {seconds:.1f} s; every result within the {budget}-token budget")


if __name__ == "__main__":
    main()
