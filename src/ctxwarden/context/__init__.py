"""Context toolkit (client side, no torch): count, fit, chunk and assemble text for a window.

    from ctxwarden.context import load_tokenizer, chunk, fit, assemble
    tok = load_tokenizer()                      # the default model's (SmolLM2, from its GGUF)
    tok.count(text); tok.count_chat(messages)   # exact, chat template included
    chunk(text, 512, tok, overlap_tokens=64)    # every chunk re-counted, <= 512
    fit(text_or_messages, 8192, 256, tok, "keep-tail-semantic")   # ranker: hybrid if the model is installed
    rank_segments(question, sentences, ranker="hybrid")          # the ranker fit, assemble and the server share
"""

from ctxwarden.context.assemble import Assembly, Fragment, IntentRoutes, assemble, fragment_from_dict
from ctxwarden.context.chunk import Chunk, ChunkTooSmall, chunk
from ctxwarden.context.fit import STRATEGIES, FitResult, fit
from ctxwarden.context.rank import RANKERS, Ranking, rank_segments
from ctxwarden.context.tokenizers import (ChatMessage, Tokenizer, available_tokenizer_names, build_gguf_tokenizer,
                                          load_tokenizer)

__all__ = ["Assembly", "ChatMessage", "Chunk", "ChunkTooSmall", "FitResult", "Fragment", "IntentRoutes",
           "RANKERS", "Ranking", "STRATEGIES", "Tokenizer", "assemble", "available_tokenizer_names",
           "build_gguf_tokenizer", "chunk", "fit", "fragment_from_dict", "load_tokenizer", "rank_segments"]
