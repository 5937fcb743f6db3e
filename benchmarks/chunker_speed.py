"""Chunker speed and correctness: ctxwarden vs chonkie, semchunk and LangChain text splitters.

Same corpus, same tokenizer (tiktoken cl100k_base, loaded offline), same cap (512 tokens,
overlap 0). For each chunker: best-of-N wall time, number of chunks, chunks over the cap
(every chunk re-counted with cl100k), whether the chunks carry exact offsets / join back to
the text, and U+FFFD characters introduced (a cut inside a multi-byte character).

    python benchmarks/chunker_speed.py [--repeats 3] [--out benchmarks/results]

A peer that is not installed is skipped with a note (pip install -e '.[bench]').
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ctxwarden.context import chunk, load_tokenizer
from ctxwarden.context.tokenizers import tiktoken_cache_dir

ROOT = Path(__file__).resolve().parents[1]
CORPORA = ROOT.parent / "shared" / "corpora"
if not CORPORA.is_dir():
    CORPORA = Path("/work/shared/corpora")
CHUNK_TOKENS = 512


@dataclass(frozen=True)
class Pieces:
    """What a chunker returned: texts, and (start, end) offsets when it gives them."""

    texts: list[str]
    offsets: list[tuple[int, int]] | None


@dataclass(frozen=True)
class Row:
    chunker: str
    corpus: str
    seconds_best: float
    num_chunks: int
    num_over_cap: int
    max_chunk_tokens: int
    offsets_exact: bool | None  # None: the chunker gives no offsets
    joins_back: bool
    replacement_chars_added: int


def mixed_script_corpus() -> str:
    """Chinese, Japanese, emoji sequences, combining marks and a long unbroken string."""
    zh = "长上下文推理需要精确的令牌计数，否则请求会在中途失败。我们在发送之前先计算长度，然后再决定如何截断。"
    ja = "長い文書を分割するときは、文字の途中で切らないことが大切です。絵文字も同じです。"
    emoji = "家族👨‍👩‍👧‍👦と国旗🇯🇵🇫🇷、肌の色👍🏽👋🏿、キーキャップ1️⃣、結合文字 é ñ ä̈. "
    prose = "Plain English sentences sit between them, with commas, semicolons; and questions? "
    paragraph = (zh * 3 + ja * 3 + emoji * 4 + prose * 2).strip()
    return "\n\n".join([paragraph] * 120) + "\n\n" + "x" * 6000 + "\n\n" + "😀" * 1500


def load_corpora() -> dict[str, str]:
    return {"emma": (CORPORA / "austen" / "emma.txt").read_text(),
            "python-docs": (CORPORA / "python-docs.rst").read_text(),
            "mixed-script": mixed_script_corpus()}


Factory = Callable[[], Callable[[str], Pieces]]


def make_chunkers(encoding) -> tuple[dict[str, Factory], list[str]]:
    """Our chunker and every installed peer, each as a factory of text -> Pieces (a fresh
    instance per timed run, so memoizing peers such as semchunk get no warm cache); plus
    notes on skipped peers."""
    ours = load_tokenizer("cl100k_base")
    chunkers: dict[str, Factory] = {
        "ctxwarden chunk (paragraph)": lambda: lambda t: _ours(t, ours, "paragraph"),
        "ctxwarden chunk (token)": lambda: lambda t: _ours(t, ours, "token"),
    }
    notes: list[str] = []
    for add in (_add_chonkie, _add_semchunk, _add_langchain):
        try:
            chunkers.update(add(encoding))
        except ImportError as e:
            notes.append(f"skipped {add.__name__[5:]}: not installed ({e.name}); pip install -e '.[bench]'")
    return chunkers, notes


def _ours(text: str, tok, boundaries: str) -> Pieces:
    chunks = chunk(text, CHUNK_TOKENS, tok, boundaries=boundaries)
    return Pieces([c.text for c in chunks], [(c.start, c.end) for c in chunks])


def _add_chonkie(encoding) -> dict[str, Factory]:
    from chonkie import RecursiveChunker, SentenceChunker, TokenChunker

    def wrap(make):
        def factory():
            chunker = make()

            def run(text: str) -> Pieces:
                out = chunker.chunk(text)
                return Pieces([c.text for c in out], [(c.start_index, c.end_index) for c in out])
            return run
        return factory

    return {"chonkie TokenChunker": wrap(lambda: TokenChunker(encoding, chunk_size=CHUNK_TOKENS, chunk_overlap=0)),
            "chonkie SentenceChunker": wrap(lambda: SentenceChunker(encoding, chunk_size=CHUNK_TOKENS,
                                                                    chunk_overlap=0)),
            "chonkie RecursiveChunker": wrap(lambda: RecursiveChunker(encoding, chunk_size=CHUNK_TOKENS))}


def _add_semchunk(encoding) -> dict[str, Factory]:
    import semchunk

    def factory():
        chunker = semchunk.chunkerify(encoding, CHUNK_TOKENS)

        def run(text: str) -> Pieces:
            texts, offsets = chunker(text, offsets=True)
            return Pieces(list(texts), [tuple(o) for o in offsets])
        return run

    return {"semchunk": factory}


def _add_langchain(encoding) -> dict[str, Factory]:
    from langchain_text_splitters import RecursiveCharacterTextSplitter, TokenTextSplitter

    def rec():
        splitter = RecursiveCharacterTextSplitter.from_tiktoken_encoder(
            encoding_name="cl100k_base", chunk_size=CHUNK_TOKENS, chunk_overlap=0)
        return lambda t: Pieces(splitter.split_text(t), None)

    def tok():
        splitter = TokenTextSplitter(encoding_name="cl100k_base", chunk_size=CHUNK_TOKENS, chunk_overlap=0)
        return lambda t: Pieces(splitter.split_text(t), None)

    return {"LangChain RecursiveCharacterTextSplitter": rec, "LangChain TokenTextSplitter": tok}


def measure(name: str, factory: Factory, corpus: str, text: str, tok, repeats: int) -> Row:
    """Best-of-repeats wall time (fresh chunker each run, construction untimed) and the checks."""
    times = []
    for _ in range(repeats):
        run = factory()
        t0 = time.perf_counter()
        pieces = run(text)
        times.append(time.perf_counter() - t0)
    counts = tok.count_many(pieces.texts)
    offsets_exact = None if pieces.offsets is None else all(
        text[a:b] == s for s, (a, b) in zip(pieces.texts, pieces.offsets))
    fffd = sum(s.count("\ufffd") for s in pieces.texts) - text.count("\ufffd")
    return Row(name, corpus, min(times), len(pieces.texts), sum(n > CHUNK_TOKENS for n in counts),
               max(counts, default=0), offsets_exact, "".join(pieces.texts) == text, fffd)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = list(dict.fromkeys(r.corpus for r in rows))
    names = list(dict.fromkeys(r.chunker for r in rows))
    fig, ax = plt.subplots(figsize=(11, 5.5))
    width = 0.8 / len(corpora)
    for k, corpus in enumerate(corpora):
        by = {r.chunker: r for r in rows if r.corpus == corpus}
        xs = [i + k * width for i in range(len(names))]
        ax.bar(xs, [by[n].seconds_best if n in by else 0 for n in names], width, label=corpus)
        for x, n in zip(xs, names):
            if n in by and by[n].num_over_cap:
                ax.text(x, by[n].seconds_best, f"{by[n].num_over_cap} over", ha="center", va="bottom",
                        fontsize=7, color="red", rotation=90)
    ax.set_xticks([i + width * (len(corpora) - 1) / 2 for i in range(len(names))])
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("seconds (best of runs)")
    ax.set_title(f"Chunking to {CHUNK_TOKENS} cl100k tokens, overlap 0 (red: chunks over the cap)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(rows: list[Row]) -> str:
    lines = ["| chunker | corpus | seconds | chunks | over cap | max tokens | offsets exact | joins back | U+FFFD added |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        off = "n/a" if r.offsets_exact is None else ("yes" if r.offsets_exact else "no")
        lines.append(f"| {r.chunker} | {r.corpus} | {r.seconds_best:.3f} | {r.num_chunks} | {r.num_over_cap} | "
                     f"{r.max_chunk_tokens} | {off} | {'yes' if r.joins_back else 'no'} | {r.replacement_chars_added} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    tok = load_tokenizer("cl100k_base")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(tiktoken_cache_dir())  # peers load cl100k by name: offline copy
    chunkers, notes = make_chunkers(tok.backend)
    rows = [measure(name, factory, corpus, text, tok, args.repeats)
            for corpus, text in load_corpora().items() for name, factory in chunkers.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"chunk_tokens": CHUNK_TOKENS, "overlap_tokens": 0, "tokenizer": "cl100k_base", "repeats": args.repeats,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_average_1min_after": os.getloadavg()[0], "notes": notes}
    (args.out / "chunker_speed.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    plot(rows, args.out / "chunker_speed.png")
    print(markdown(rows))
    for n in notes:
        print("note:", n)


if __name__ == "__main__":
    main()
