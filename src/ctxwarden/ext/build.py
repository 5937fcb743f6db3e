"""Build ctxwarden's C++ kernels: `python -m ctxwarden.ext.build` (run by `make install`).

Never fails the install: without a working compiler it says so and exits 0, and ctxwarden
runs on its plain-torch paths.
"""

from __future__ import annotations

import shutil
import sys

from ctxwarden.ext import BUILD_DIR, MODULE_NAME, SOURCE

import os

FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast",
         *os.environ.get("CTXWARDEN_EXT_CFLAGS", "").split()]  # -D overrides, to measure


def build(verbose: bool = False) -> bool:
    """Compile kernels.cpp into ctxwarden/ext/_build; True if the module loads afterwards."""
    from torch.utils import cpp_extension

    shutil.rmtree(BUILD_DIR, ignore_errors=True)
    BUILD_DIR.mkdir(parents=True)
    try:
        cpp_extension.load(MODULE_NAME, [str(SOURCE)], extra_cflags=FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(BUILD_DIR),
                           verbose=verbose)
    except (RuntimeError, OSError, ImportError) as e:  # no compiler, no ninja, bad flags
        print(f"ctxwarden: C++ kernels not built ({type(e).__name__}: {str(e)[-300:]}); "
              "the plain-torch paths will be used", file=sys.stderr)
        return False
    from ctxwarden.ext import kernels

    kernels.cache_clear()
    return kernels() is not None


def main() -> int:
    """Build and report; exit status 0 either way (the kernels are optional)."""
    ok = build(verbose="-v" in sys.argv)
    print(f"ctxwarden C++ kernels: {'built' if ok else 'NOT built (fallback to torch)'} in {BUILD_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
