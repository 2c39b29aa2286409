"""Tune page: what `gpuprof tune` measured. Each trial's speedup with its interval beside its finding's
estimate, numerics parity and the verdict after it, then the change to make for the winning set; every
trial's own run one click away on the Run page."""

from __future__ import annotations

from urllib.parse import urlencode

import pandas as pd
import streamlit as st

from gpuprof.dashboard import data
from gpuprof.dashboard.charts import tune_trials_panel
from gpuprof.dashboard.views.common import escape_markdown, section, show_panel
from gpuprof.report.tuning import TRIAL_HEADERS, diff_title, text_lines, trial_label, trial_rows

COLUMNS = {
    "estimate": st.column_config.TextColumn("estimate", help="the speedup the finding's expected gain amounts to"),
    "measured (95% CI)": st.column_config.TextColumn(
        "measured (95% CI)", help="against the baseline runs either side of the trial; above 1× is faster"),
    "numerics": st.column_config.TextColumn("numerics", help="the loss curve over the same steps against the baseline's"),
}


def render(root, entries, selected) -> None:
    tunes = data.tune_results(root)
    if not tunes:
        st.info("No `gpuprof tune` results under this folder. `gpuprof tune SCRIPT [ARGS...]` measures each "
                "recommended fix in a trial of its own and leaves its result here (`--out DIR`, by default "
                "runs/tune-<script>-<time>).")
        return
    chosen = st.selectbox("Tune result", tunes, format_func=lambda entry: entry.name, key="tune_result")
    st.header(f"Tune · `{chosen.name}`")
    if chosen.error:
        st.error(chosen.error)
        return
    with section("Trials"):
        show_result(chosen, {entry.name for entry in entries if entry.ok})


def show_result(tune: data.TuneEntry, run_names: set[str]) -> None:
    result = tune.result
    lines = text_lines(result)
    (st.success if result.get("winner") else st.info)(escape_markdown(result["conclusion"]))
    st.caption(escape_markdown(f"{result['target']} · " + " ".join(lines["above"])))
    st.dataframe(pd.DataFrame(trial_rows(result), columns=TRIAL_HEADERS), hide_index=True, column_config=COLUMNS,
                 key="tune_trials")
    show_panel(tune_trials_panel(result["trials"]))
    for line in lines["below"][:-1]:  # the last is the conclusion, shown first
        st.markdown(f"- {escape_markdown(line)}")
    if result["diff"]:
        st.markdown(f"**{diff_title(result).capitalize()}**")
        st.code(result["diff"], language="diff" if result["diff"].startswith("---") else "bash")
        for line in lines["after_diff"][:-1]:
            st.caption(escape_markdown(line))
    show_trial_links(tune, result, run_names)


def show_trial_links(tune: data.TuneEntry, result: dict, run_names: set[str]) -> None:
    """Links to each trial's run (and the baseline's) on the Run page, for the runs the folder still holds."""
    trials = [result["baseline"], *result["trials"], *result.get("baseline_reruns", [])]
    links = [f"[{escape_markdown(trial_label(trial))}](?{urlencode({'page': 'Run', 'run': name})})"
             for trial in trials if (name := tune.run_name(trial)) in run_names]
    if links:
        st.markdown("**Each trial's run:** " + " · ".join(links))
