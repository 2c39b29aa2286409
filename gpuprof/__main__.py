import sys

from gpuprof.cli import main

sys.exit(main())
