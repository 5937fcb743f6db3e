"""Mixed-script text for property tests: emoji sequences, CJK, combining marks, CR LF."""

from __future__ import annotations

from hypothesis import strategies as st

# Pieces that stress tokenizers and cutters: multi-byte characters, emoji sequences
# (ZWJ families, flags, skin tones, keycaps), combining marks, CJK without spaces, CR LF.
HARD_PIECES = [
    "👨‍👩‍👧‍👦", "🇫🇷", "🇯🇵🇰🇷", "👍🏽", "🧑🏿‍🚀", "1️⃣", "é", "é", "ñ", "ä̈", "日本語の文章です。",
    "中文句子，没有空格。", "한국어 문장", "Ελληνικά", "русский текст", "عربي", "\r\n", "\n\n", "  ",
    "Mr. Knightley said: \"Yes!\" ", "x² 3.14159 ", "<|im_end|>", "a" * 40, "😀" * 12, "\t",
]


@st.composite
def mixed_text(draw, min_pieces: int = 0, max_pieces: int = 40) -> str:
    """Text mixing prose, scripts, emoji sequences and arbitrary code points."""
    piece = st.one_of(
        st.sampled_from(HARD_PIECES),
        st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
        st.sampled_from(["The cat sat. ", "It rained, and then it stopped; ", "Why? ", "word ", "\n"]),
    )
    return "".join(draw(st.lists(piece, min_size=min_pieces, max_size=max_pieces)))
