"""`python -m gpuprof ...`: the command line (gpuprof.cli)."""

import sys

from gpuprof.cli import main

sys.exit(main())
