"""`python corpus_runner.py PATCHES_JSON GPUPROF_RUN_ARGS...`: applies the patches, then runs `gpuprof run`.

PATCHES_JSON is a list of ["module:function", {kwargs}]; each function is called once, in order,
in this process, before `gpuprof run` starts the script (script_corpus.py describes them).
"""

import importlib
import json
import sys

from gpuprof.cli import main


def apply(patches: list) -> None:
    for target, kwargs in patches:
        module_name, function_name = target.split(":")
        getattr(importlib.import_module(module_name), function_name)(**kwargs)


if __name__ == "__main__":
    apply(json.loads(sys.argv[1]))
    sys.exit(main(["run", *sys.argv[2:]]))
