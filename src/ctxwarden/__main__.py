import sys

from ctxwarden.cli import main

sys.exit(main())
