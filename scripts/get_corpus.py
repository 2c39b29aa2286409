"""Fill the cache of real public training scripts that the tests run (tests/scripts/corpus_cache.py says how)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "scripts"))

from corpus_cache import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
