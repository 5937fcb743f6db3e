"""ctxwarden's optional C++ kernels (kernels.cpp), built once by `make install`.

`python -m ctxwarden.ext.build` compiles kernels.cpp with the machine's compiler into
`_build/` beside this file (torch.utils.cpp_extension, -O3 -march=native: the machine that
installs is the machine that runs). `kernels()` imports the built module, or returns None
when it was never built or cannot load; every caller then takes its plain-torch path, so a
machine without a compiler still runs, only slower. Set CTXWARDEN_NO_EXT=1 to force the
fallback (the tests run both ways), CTXWARDEN_AMX=0 to keep the kernels off AMX's tile
units where they would use them.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from functools import lru_cache
from pathlib import Path

MODULE_NAME = "ctxwarden_kernels"
SOURCE = Path(__file__).with_name("kernels.cpp")
BUILD_DIR = Path(__file__).with_name("_build")


def built_library() -> Path | None:
    """The compiled module's file, if `make install` built one."""
    found = sorted(BUILD_DIR.glob(f"{MODULE_NAME}*.so"))
    return found[0] if found else None


@lru_cache(maxsize=1)
def kernels():
    """The compiled kernels module, or None (not built, disabled, or failed to load)."""
    if os.environ.get("CTXWARDEN_NO_EXT"):
        return None
    path = built_library()
    if path is None or path.stat().st_mtime < SOURCE.stat().st_mtime:
        return None  # never built, or built from an older kernels.cpp: rebuild with make install
    import torch  # noqa: F401  (the module links against torch's libraries)

    try:
        module = load_module(path)
    except (ImportError, OSError):
        return None
    if os.environ.get("CTXWARDEN_AMX", "").strip() == "0" and hasattr(module, "set_amx"):
        module.set_amx(False)  # the AVX-512 tiles instead of AMX's (to measure one against the other)
    return module


def load_module(path: Path):
    """Import a built kernels module from `path` (benchmarks time an older build this way)."""
    import torch  # noqa: F401

    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    if Path(module.__file__).resolve() != Path(path).resolve():
        # the dynamic loader hands back a library of the same soname already in the process
        raise RuntimeError(f"{path}: another build of {MODULE_NAME} ({module.__file__}) is already loaded "
                           "in this process and would be timed instead; load this one in a fresh process")
    return module



def simd_level() -> str:
    """Vector set the built kernels use: "avx512", "avx2", "none" (scalar loops), or
    "not built" (absent, disabled, or stale)."""
    ext = kernels()
    return "not built" if ext is None else ext.simd_level()


def has_vector_kernels() -> bool:
    """Whether the kernels are built with a vector path (AVX-512 or AVX2 + FMA).

    Their scalar fallback multiplies a q4 / q8 weight 7.5-13x slower than a dense fp32
    matvec at one row, 40x at 16 rows (measured on an AVX2 EPYC), so without a vector path quantized weights are
    dequantized at load instead of kept.
    """
    return simd_level() in ("avx512", "avx2")
