"""What a model is, before anything is loaded (no torch): its spec, files and dtypes.

    model_spec.py   ModelSpec parsed from config.json (transformers 4.x / 5.x)
    checkpoint.py   resolve a MODEL argument (dir, config.json, .gguf, default) -> Checkpoint
    gguf_header.py  the one GGUF header reader (metadata and tensor infos)
    dtypes.py       one dtype vocabulary and byte table for every stage
"""
