"""`streamlit run dashboard/app.py -- RUNS_DIR`: the same app `gpuprof dashboard` serves."""

import runpy

from gpuprof.dashboard import APP_PATH

runpy.run_path(str(APP_PATH), run_name="__main__")
