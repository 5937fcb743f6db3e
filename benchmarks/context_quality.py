"""Long-document QA under a budget: hard truncation vs keep-tail-semantic with each ranker.

Real excerpts from the Austen novels and the Python docs (alternately), 2-8x the prompt
budget, with four facts planted as their own paragraphs at depths 0.1 / 0.35 / 0.6 / 0.85
and a question about one of them at the end. Three question sets on the same excerpts:

  lexical     the question repeats the fact's words ("What is the vault code of Captain Merrow?")
  paraphrase  fact and question share only a name (a frequent name of the excerpt, in all four facts)
  no-overlap  fact and question share no content word at all (checked automatically: no common
              word, stem or 4+ letter substring once stopwords are dropped); written per corpus

Strategies: truncate-head / -middle / -tail, and keep-tail-semantic with the lexical (BM25),
dense (all-MiniLM-L6-v2) and hybrid (both, rank-fused) rankers. Two scores:

  survival    whether the question and the answer-bearing sentence both survive the fit
  log p       SmolLM2-135M-Instruct's teacher-forced log p of the answer after the fitted
              prompt (chat template, then "The answer is "), summed over the answer's tokens:
              the model's own view of whether the fit kept what it needs (higher is better)

    python benchmarks/context_quality.py [--docs 60] [--logp-docs 20] [--corpora DIR]

The fitter never sees the answer: rankers see the question and the document only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from ctxwarden.context import fit, load_tokenizer
from ctxwarden.context.rank import terms

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPORA = ROOT.parent / "shared" / "corpora"
KINDS = ("lexical", "paraphrase", "no-overlap")
RANKERS = ("lexical", "dense", "hybrid")  # keep-tail-semantic with each ranker
STRATEGIES = ("truncate-head", "truncate-middle", "truncate-tail", *RANKERS)
CORPUS_NAMES = ("austen", "python-docs")
DEPTHS = (0.1, 0.35, 0.6, 0.85)
RATIOS = (2, 3, 4, 6, 8)
ANSWER_PREFIX = "The answer is "
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
# The no-overlap set: (fact, question), no content word in common, one list per corpus so that
# the fact reads like its surroundings. {n} is the answer (a number, never in the question).
NO_OVERLAP = {
    "austen": [
        ("The vicar's housekeeper hid {n} gold sovereigns beneath a loose floorboard in the pantry.",
         "How many coins did the clergyman's servant conceal under the kitchen store-room planks?"),
        ("Every winter the old squire burns {n} cartloads of oak logs in his great hall.",
         "How many wagons of firewood does the elderly landowner consume during the cold season?"),
        ("Colonel Ashby's stable holds {n} chestnut mares bred for racing.",
         "How many brown female horses, raised for speed contests, does the army officer keep?"),
        ("Her aunt wrote {n} letters to London that April.",
         "How much correspondence did the young woman's relative send to the English capital in spring?"),
        ("The dowry settled on the eldest sister amounted to {n} hundred pounds.",
         "What marriage portion was promised to the firstborn girl?"),
        ("At the harvest ball the band played {n} country dances before supper.",
         "How many rustic reels did the musicians perform ahead of the evening meal at the autumn party?"),
        ("The gardener planted {n} rose bushes along the south wall.",
         "How many flowering shrubs did the groundskeeper put in beside the sunny side of the enclosure?"),
        ("Each footman at the manor earns {n} guineas a year.",
         "What annual salary do the male house servants of the estate receive?"),
        ("The curate owes the village baker {n} shillings.",
         "What sum is the junior clergyman in debt to the local bread maker?"),
        ("Lady Morland keeps {n} wax candles burning in the drawing room every evening.",
         "How many tapers stay lit in the noblewoman's parlour each night?"),
        ("The carriage journey from Highbury to the coast took {n} hours.",
         "How long did the coach ride to the seaside last?"),
        ("Her late uncle left a library of {n} volumes to the parish.",
         "How many books did the girl's deceased relative bequeath to the local church community?"),
    ],
    "python-docs": [
        ("The garbage collector of this interpreter build scans the youngest generation after every {n} "
         "allocations.", "How often does automatic memory reclamation examine the newest objects?"),
        ("The default recursion limit on the build server is set to {n} frames.",
         "How deep may nested function calls go on the continuous-integration machine before an error?"),
        ("Our socket wrapper waits {n} seconds before abandoning an unanswered connection attempt.",
         "What timeout does the network helper apply when a remote host stays silent?"),
        ("The team's style guide caps source lines at {n} characters.",
         "What is the maximum width of code rows according to the group's formatting rules?"),
        ("The thread pool in the web service starts {n} worker threads at launch.",
         "How many concurrent executors does the HTTP application spawn on startup?"),
        ("The nightly test suite runs {n} unit tests against the parser.",
         "How many automated checks exercise the grammar reader every evening?"),
        ("The package index mirror stores {n} gigabytes of wheels.",
         "How much disk space do the cached distribution archives occupy on the local repository copy?"),
        ("Dictionary lookups in the benchmark took {n} nanoseconds on average.",
         "What was the mean time of a hash-map access in the speed measurement?"),
        ("The logging module in our deployment rotates its files after {n} megabytes.",
         "At what size does the application's record-keeping component open a fresh output?"),
        ("The release branch pins the cryptography library to version {n}.",
         "Which edition of the encryption dependency is locked for shipping?"),
        ("Importing the standard email package costs {n} milliseconds at startup.",
         "How long does loading the built-in electronic-message modules take when a program begins?"),
        ("The asyncio event loop in the crawler handles {n} open sockets at once.",
         "How many simultaneous network connections does the coroutine scheduler of the spider manage?"),
    ],
}
_NAME_RE = re.compile(r"\b(?:Mr|Mrs|Miss|Captain|Colonel|Lady|Sir)\.? [A-Z][a-z]+")
_SUFFIXES = ("ings", "ing", "ies", "ied", "ed", "es", "s", "ly", "er", "est", "ion", "al")


def _stem(word: str) -> str:
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)]
    return word


def shared_content_words(fact: str, question: str) -> list[str]:
    """Content words the two share: equal words, equal stems, or one (4+ letters) inside the other."""
    fact_words = set(terms(fact.replace("{n}", " ")))
    shared = []
    for q in set(terms(question)):
        for f in fact_words:
            long_enough = min(len(q), len(f)) >= 4
            if q == f or _stem(q) == _stem(f) or (long_enough and (q in f or f in q)):
                shared.append(f"{q}~{f}")
    return sorted(shared)


def check_no_overlap_set() -> dict[str, int]:
    """Raise if any no-overlap question shares a content word with its fact; pairs checked per corpus."""
    bad = {f"{corpus}: {q}": shared_content_words(f, q)
           for corpus, pairs in NO_OVERLAP.items() for f, q in pairs if shared_content_words(f, q)}
    if bad:
        raise AssertionError(f"no-overlap pairs that share content words: {bad}")
    return {corpus: len(pairs) for corpus, pairs in NO_OVERLAP.items()}


@dataclass(frozen=True)
class Case:
    doc_id: int
    kind: str
    corpus: str
    ratio: int
    asked_depth: float
    text: str
    question: str
    evidence: str
    answer: str


@dataclass(frozen=True)
class Outcome:
    doc_id: int
    kind: str
    corpus: str
    strategy: str
    ratio: int
    asked_depth: float
    question_kept: bool
    evidence_kept: bool
    prompt_tokens: int
    ranker: str | None
    answer_logprob: float | None = None


def corpora_dir(arg: str | None) -> Path:
    """--corpora, else $CTXWARDEN_CORPORA, else ../shared/corpora beside the checkout."""
    path = Path(arg or os.environ.get("CTXWARDEN_CORPORA") or DEFAULT_CORPORA)
    if not (path / "python-docs.rst").is_file():
        raise SystemExit(f"corpora not found in {path}: pass --corpora DIR or set CTXWARDEN_CORPORA")
    return path


def _excerpt(rng: random.Random, src: str, tok, num_tokens: int) -> str:
    """A contiguous excerpt of about num_tokens tokens, starting at a paragraph."""
    approx_chars = num_tokens * 4
    start = src.find("\n\n", rng.randrange(0, max(1, len(src) - approx_chars * 2))) + 2
    piece = src[start:start + approx_chars * 2]
    cuts = tok.cuts(piece)
    k = min(len(cuts.cut_chars) - 1, num_tokens)
    return piece[: int(cuts.cut_chars[k])]


def _plant(doc: str, facts: list[str]) -> str:
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


def _lexical_case(rng: random.Random, doc: str, corpus: str) -> tuple[list[str], list[str], int, str]:
    attrs, ents = rng.sample(ATTRIBUTES, len(DEPTHS)), rng.sample(ENTITIES, len(DEPTHS))
    values = [rng.choice(COLOURS) if "colour" in a else str(rng.randint(1000, 9999)) for a in attrs]
    facts = [f"The {a} of {e} is {v}." for a, e, v in zip(attrs, ents, values)]
    asked = rng.randrange(len(DEPTHS))
    return facts, values, asked, f"\n\nQuestion: What is the {attrs[asked]} of {ents[asked]}?"


def _paraphrase_case(rng: random.Random, doc: str, corpus: str) -> tuple[list[str], list[str], int, str]:
    entity = _frequent_name(rng, doc)
    pairs = rng.sample(PARAPHRASES, len(DEPTHS))
    values = [str(rng.randint(10, 999)) for _ in pairs]
    facts = [f"{entity} {fact.format(n=v)}." for (fact, _), v in zip(pairs, values)]
    asked = rng.randrange(len(DEPTHS))
    return facts, values, asked, "\n\nQuestion: " + pairs[asked][1].format(e=entity)


def _no_overlap_case(rng: random.Random, doc: str, corpus: str) -> tuple[list[str], list[str], int, str]:
    pairs = rng.sample(NO_OVERLAP[corpus], len(DEPTHS))
    values = [str(rng.randint(10, 999)) for _ in pairs]
    facts = [fact.format(n=v) for (fact, _), v in zip(pairs, values)]
    asked = rng.randrange(len(DEPTHS))
    return facts, values, asked, "\n\nQuestion: " + pairs[asked][1]


MAKERS = {"lexical": _lexical_case, "paraphrase": _paraphrase_case, "no-overlap": _no_overlap_case}


def _sources(corpora: Path) -> dict[str, list[str]]:
    return {"austen": [p.read_text() for p in sorted((corpora / "austen").glob("*.txt"))],
            "python-docs": [(corpora / "python-docs.rst").read_text()]}


def make_cases(num_docs: int, budget_tokens: int, tok, corpora: Path, seed: int = 1234) -> list[Case]:
    """num_docs excerpts (Austen and Python docs in turn), one case per question set on each."""
    rng = random.Random(seed)
    sources = _sources(corpora)
    cases = []
    for i in range(num_docs):
        ratio, corpus = RATIOS[i % len(RATIOS)], CORPUS_NAMES[i % 2]
        excerpt = _excerpt(rng, rng.choice(sources[corpus]), tok, ratio * budget_tokens)
        for kind in KINDS:
            facts, values, asked, question = MAKERS[kind](rng, excerpt, corpus)
            doc = _plant(excerpt, facts)
            cases.append(Case(i, kind, corpus, ratio, DEPTHS[asked], doc + question, question, facts[asked],
                              values[asked]))
    return cases


def fit_case(case: Case, strategy: str, window: int, max_tokens: int, tok) -> tuple[Outcome, str]:
    """Fit one case with one strategy; the outcome and the fitted text."""
    ranked = strategy in RANKERS
    r = fit(case.text, window, max_tokens, tok, "keep-tail-semantic" if ranked else strategy,
            ranker=strategy if ranked else None)
    return Outcome(case.doc_id, case.kind, case.corpus, strategy, case.ratio, case.asked_depth,
                   r.text.endswith(case.question), case.evidence in r.text, r.prompt_tokens, r.ranker), r.text


def _progress() -> Progress:
    return Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn())


def run_fits(cases: list[Case], window: int, max_tokens: int, tok) -> tuple[list[Outcome], list[str], dict]:
    """Every case with every strategy; outcomes, fitted texts (same order) and seconds per strategy."""
    outcomes, texts, seconds = [], [], Counter()
    with _progress() as bar:
        task = bar.add_task("fits", total=len(cases) * len(STRATEGIES))
        for case in cases:
            for s in STRATEGIES:
                t0 = time.perf_counter()
                outcome, text = fit_case(case, s, window, max_tokens, tok)
                seconds[s] += time.perf_counter() - t0
                outcomes.append(outcome)
                texts.append(text)
                bar.advance(task)
    return outcomes, texts, {s: round(v, 2) for s, v in seconds.items()}


def answer_logprobs(prompts: list[tuple[str, str]], batch: int = 4) -> list[float]:
    """Teacher-forced log p of each answer after its fitted text (chat template + ANSWER_PREFIX)."""
    from ctxwarden import LLM, SamplingParams

    llm = LLM(kv_memory="2GiB")
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    unique = list(dict.fromkeys(prompts))  # identical fitted prompts are scored once
    scores: dict[tuple[str, str], float] = {}
    with _progress() as bar:
        task = bar.add_task("SmolLM2 log p(answer)", total=len(unique))
        for at in range(0, len(unique), batch):
            group = unique[at:at + batch]
            ids = [_scored_ids(llm, text, answer) for text, answer in group]
            outs = llm.generate([p + a for p, a in ids], params, show_progress=False)
            for key, (p, a), out in zip(group, ids, outs):
                scores[key] = sum(lp.logprob for lp in out.prompt_logprobs[len(p):])
            bar.advance(task, len(group))
            if not bar.console.is_terminal:  # a log file: say how far it got
                print(f"scored {min(at + batch, len(unique))}/{len(unique)}", flush=True)
    return [scores[p] for p in prompts]


def _scored_ids(llm, text: str, answer: str) -> tuple[list[int], list[int]]:
    """(context ids: chat template + answer prefix, answer ids); the answer is scored token by token."""
    context = llm.apply_chat_template([{"role": "user", "content": text}]) + llm.tokenizer.encode(ANSWER_PREFIX)
    return context, llm.tokenizer.encode(answer)


def add_logprobs(outcomes: list[Outcome], texts: list[str], cases: list[Case], logp_docs: int,
                 logp_kinds: tuple[str, ...]) -> list[Outcome]:
    """Score the outcomes of the first logp_docs excerpts in logp_kinds with SmolLM2."""
    answer = {(c.doc_id, c.kind): c.answer for c in cases}
    chosen = [i for i, o in enumerate(outcomes) if o.doc_id < logp_docs and o.kind in logp_kinds]
    if not chosen:
        return outcomes
    lps = answer_logprobs([(texts[i], answer[outcomes[i].doc_id, outcomes[i].kind]) for i in chosen])
    out = list(outcomes)
    for i, lp in zip(chosen, lps):
        out[i] = replace(out[i], answer_logprob=round(lp, 4))
    return out


def _rate(items: list[Outcome], attr: str) -> float:
    return round(100.0 * sum(getattr(o, attr) for o in items) / max(len(items), 1), 1)


def _both(items: list[Outcome]) -> float:
    return round(100.0 * sum(o.question_kept and o.evidence_kept for o in items) / max(len(items), 1), 1)


def _logp_stats(items: list[Outcome]) -> dict | None:
    lps = sorted(o.answer_logprob for o in items if o.answer_logprob is not None)
    if not lps:
        return None
    q = statistics.quantiles(lps, n=4) if len(lps) > 1 else [lps[0]] * 3
    return {"n": len(lps), "mean": round(statistics.fmean(lps), 3), "median": round(statistics.median(lps), 3),
            "q1": round(q[0], 3), "q3": round(q[2], 3), "min": round(lps[0], 3), "max": round(lps[-1], 3)}


def summarise(outcomes: list[Outcome]) -> dict:
    """Per set and strategy: question / evidence / both kept (by depth, ratio, corpus) and log p."""
    out: dict = {}
    for kind in KINDS:
        for s in STRATEGIES:
            mine = [o for o in outcomes if o.strategy == s and o.kind == kind]
            out.setdefault(kind, {})[s] = {
                "question_kept_pct": _rate(mine, "question_kept"), "evidence_kept_pct": _rate(mine, "evidence_kept"),
                "both_kept_pct": _both(mine),
                "both_by_corpus_pct": {c: _both([o for o in mine if o.corpus == c]) for c in CORPUS_NAMES},
                "evidence_by_depth_pct": {str(d): _rate([o for o in mine if o.asked_depth == d], "evidence_kept")
                                          for d in DEPTHS},
                "evidence_by_ratio_pct": {str(x): _rate([o for o in mine if o.ratio == x], "evidence_kept")
                                          for x in RATIOS},
                "answer_logprob": _logp_stats(mine),
                "answer_logprob_evidence_kept": _logp_stats([o for o in mine if o.evidence_kept and o.question_kept]),
                "answer_logprob_evidence_lost": _logp_stats([o for o in mine if not o.evidence_kept])}
    return out


def plot(summary: dict, path: Path) -> None:
    """Survival per set and strategy; no-overlap evidence by overflow; SmolLM2 log p per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    width = 0.8 / len(STRATEGIES)
    for j, s in enumerate(STRATEGIES):
        x = np.arange(len(KINDS)) + (j - (len(STRATEGIES) - 1) / 2) * width
        axes[0].bar(x, [summary[k][s]["both_kept_pct"] for k in KINDS], width, label=s)
        axes[1].plot(RATIOS, [summary["no-overlap"][s]["evidence_by_ratio_pct"][str(r)] for r in RATIOS],
                     marker="o", label=s)
        _plot_logp(axes[2], summary, s, j, width)
    axes[0].set_xticks(range(len(KINDS)), KINDS)
    axes[0].set_ylabel("question and evidence kept (%)")
    axes[0].axhline(80, color="grey", lw=0.8, ls="--")
    axes[1].set_xlabel("no-overlap set: document tokens / budget")
    axes[1].set_ylabel("evidence kept (%)")
    axes[2].set_xticks(range(len(KINDS)), KINDS)
    axes[2].set_ylabel("SmolLM2 log p(answer): median, quartiles")
    for ax in axes:
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(STRATEGIES), fontsize=9)
    fig.suptitle("Long-document QA: does the answer survive fitting, and does the model then know it? "
                 "(lexical / dense / hybrid = keep-tail-semantic with that ranker)")
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=120)


def _plot_logp(ax, summary: dict, strategy: str, j: int, width: float) -> None:
    for i, kind in enumerate(KINDS):
        st = summary[kind][strategy]["answer_logprob"]
        if st is None:
            continue
        x = i + (j - (len(STRATEGIES) - 1) / 2) * width
        ax.errorbar([x], [st["median"]], yerr=[[st["median"] - st["q1"]], [st["q3"] - st["median"]]], fmt="o",
                    color=f"C{j}", capsize=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=60, help="excerpts; each gives one case per question set")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--logp-docs", type=int, default=20, help="excerpts scored by SmolLM2 (0: none)")
    ap.add_argument("--logp-sets", default="lexical,no-overlap", help="question sets scored by SmolLM2")
    ap.add_argument("--corpora", default=None, help="default: $CTXWARDEN_CORPORA or ../shared/corpora")
    ap.add_argument("--tokenizer", default=None, help="default: the default model's (SmolLM2)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    pairs_checked = check_no_overlap_set()
    tok = load_tokenizer(args.tokenizer)
    budget = args.window - args.max_tokens
    cases = make_cases(args.docs, budget, tok, corpora_dir(args.corpora), args.seed)
    t0 = time.perf_counter()
    outcomes, texts, seconds = run_fits(cases, args.window, args.max_tokens, tok)
    fit_s = time.perf_counter() - t0
    assert all(o.prompt_tokens <= budget for o in outcomes)
    print(f"{len(outcomes)} fits in {fit_s:.1f} s; scoring with SmolLM2", flush=True)
    outcomes = add_logprobs(outcomes, texts, cases, args.logp_docs, tuple(args.logp_sets.split(",")))
    summary = summarise(outcomes)
    meta = {"docs": args.docs, "window": args.window, "max_tokens": args.max_tokens, "seed": args.seed,
            "tokenizer": tok.name, "depths": DEPTHS, "ratios": RATIOS, "seconds_all_fits": round(fit_s, 2),
            "seconds_by_strategy": seconds, "logp_docs": args.logp_docs, "logp_sets": args.logp_sets,
            "no_overlap_pairs_checked": pairs_checked, "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs", "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset")}
    _write(args.out, meta, summary, outcomes)
    _print_table(summary)
    print(f"{len(outcomes)} fits in {fit_s:.1f} s; every result within the {budget}-token budget")


def _write(out: Path, meta: dict, summary: dict, outcomes: list[Outcome]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "context_quality.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "outcomes": [asdict(o) for o in outcomes]}, indent=2))
    plot(summary, out / "context_quality.png")


def _print_table(summary: dict) -> None:
    print("| set | strategy | question kept | evidence kept | both | both: austen / python-docs | "
          "log p(answer) median [q1, q3] |\n|---|---|---|---|---|---|---|")
    for kind, by_strategy in summary.items():
        for s, row in by_strategy.items():
            lp = row["answer_logprob"]
            lp_text = f"{lp['median']} [{lp['q1']}, {lp['q3']}] (n={lp['n']})" if lp else "-"
            corpus = " / ".join(f"{row['both_by_corpus_pct'][c]}%" for c in CORPUS_NAMES)
            print(f"| {kind} | {s} | {row['question_kept_pct']}% | {row['evidence_kept_pct']}% | "
                  f"{row['both_kept_pct']}% | {corpus} | {lp_text} |")


if __name__ == "__main__":
    main()
