"""Plotly figures of a run's timelines, shared by the Streamlit pages and `gpuprof report`.

Every builder takes the run's DataFrames (columns as in docs/run-format.md) and returns a
`Panel`: a figure, or no figure and a one-line note saying why (e.g. a CPU run has no GPU
samples). Long series are downsampled here, once, for every consumer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from gpuprof.dashboard.downsample import MAX_POINTS, bucket_mean, lttb
from gpuprof.report.format import GIB
from gpuprof.run.schema import EVAL_PHASE, SPLIT_PHASES, STEP_PHASES

HEATMAP_MAX_STEPS = 400
# Rows of a rank x step heatmap: past this many ranks, neighbouring ranks share a row.
HEATMAP_MAX_RANKS = 256
CHART_HEIGHT_PX = 320
# Every figure's template, named, so that the dashboard (where importing Streamlit makes its own template
# Plotly's default) and the HTML report draw the same colours; its axes make room for their tick labels.
CHART_TEMPLATE = "plotly_white"
# One colour per step phase on every chart that draws phases (the step's split, the ranks', a step's timeline,
# the ranks' heartbeats).
PHASE_COLORS = dict(zip(STEP_PHASES, ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#b0b0b0"),
                        strict=True))  # data, forward, backward, optimizer, eval, other


@dataclass(frozen=True)
class Panel:
    """One chart of a page: `figure` is None when the run has nothing to show, and `note` says why."""

    title: str
    figure: go.Figure | None
    note: str = ""


# One number format on every value axis and its hover: 4 significant digits, thousands separated, never an
# exponent ("1.338", "51.14", "1,980"), not a float's every digit ("1.338303").
NUMBER_FORMAT = ",.4~r"
# Above the plot area, never over it: a short chart's legend at a fraction above it would sit on its top row.
LEGEND_ABOVE = dict(orientation="h", yanchor="bottom", y=1.02, x=0)
# Beside the plot, for a chart of stacked subplots whose titles sit where a legend above would.
LEGEND_BESIDE = dict(orientation="v", xanchor="left", x=1.01, yanchor="top", y=1)


def _layout(figure: go.Figure, *, x_title: str, y_title: str = "", height: int = CHART_HEIGHT_PX) -> go.Figure:
    figure.update_layout(
        template=CHART_TEMPLATE,
        height=height,
        margin=dict(l=10, r=10, t=30, b=10),
        legend=LEGEND_ABOVE,
        hovermode="x unified",
    )
    figure.update_xaxes(title_text=x_title)
    figure.update_yaxes(tickformat=NUMBER_FORMAT, hoverformat=NUMBER_FORMAT)
    if y_title:
        figure.update_yaxes(title_text=y_title)
    return figure


def _has(frame: pd.DataFrame, column: str) -> bool:
    return column in frame.columns and frame[column].notna().any()


def _line(frame: pd.DataFrame, x: str, y: str, name: str, scale: float = 1.0, **trace) -> go.Scatter:
    # SVG, not WebGL: after LTTB a line has at most MAX_POINTS points, and a page of WebGL charts
    # runs into the browser's limit on WebGL contexts.
    points = lttb(frame, x, y, MAX_POINTS)
    return go.Scatter(x=points[x], y=points[y] * scale, name=name, mode="lines", **trace)


def _markers(x: pd.Series, y, name: str, color: str) -> go.Scatter:
    return go.Scatter(x=x, y=y, name=name, mode="markers", marker=dict(color=color, symbol="x", size=9))


def throughput_panel(steps: pd.DataFrame) -> Panel:
    """Tokens/s, and MFU under it on an axis of its own: MFU is tokens/s times a constant, so on one plot
    either line hides the other."""
    title = "Throughput and MFU"
    if not _has(steps, "tokens_per_s"):
        return Panel(title, None, "No throughput recorded: the loop passed no token counts to prof.step().")
    mfu = int(_has(steps, "mfu"))
    figure = make_subplots(rows=1 + mfu, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    figure.add_trace(_line(steps, "step", "tokens_per_s", "tokens/s"), row=1, col=1)
    figure.update_yaxes(title_text="tokens/s", rangemode="tozero", row=1, col=1)
    if mfu:
        figure.add_trace(_line(steps, "step", "mfu", "MFU %", scale=100.0), row=2, col=1)
        figure.update_yaxes(title_text="MFU %", rangemode="tozero", row=2, col=1)
    note = "" if mfu else "MFU unknown: no peak FLOP/s for this device."
    _layout(figure, x_title="", height=CHART_HEIGHT_PX * (1 + mfu) * 3 // 4)
    return Panel(title, figure.update_xaxes(title_text="step", row=1 + mfu, col=1), note)


def phases_panel(steps: pd.DataFrame) -> Panel:
    columns = [f"{phase}_time_s" for phase in STEP_PHASES if _has(steps, f"{phase}_time_s")]
    if not columns:
        return Panel("Step time by phase", None, "No step times recorded.")
    evaluation = f"{EVAL_PHASE}_time_s"
    if evaluation in columns:  # a step without evaluation spent none in it
        steps = steps.assign(**{evaluation: steps[evaluation].fillna(0.0)})
    averaged = bucket_mean(steps, "step", columns)
    figure = go.Figure()
    for column in columns:
        phase = column.removesuffix("_time_s")
        figure.add_trace(go.Scatter(
            x=averaged["step"], y=averaged[column] * 1e3, name=phase, mode="lines", stackgroup="phases",
            line=dict(width=0.5, color=PHASE_COLORS[phase]),
            hovertemplate=f"{phase} (%{{y:.1f}} ms): {STEP_PHASES[phase]}<extra></extra>",
        ))
    note = "" if len(averaged) == len(steps) else f"Averaged over buckets of ~{len(steps) // len(averaged)} steps."
    return Panel("Step time by phase", _layout(figure, x_title="step", y_title="ms"), note)


def loss_panel(steps: pd.DataFrame) -> Panel:
    if "loss" not in steps.columns or steps["loss"].isna().all():
        return Panel("Loss", None, "No loss recorded: the loop passed no loss to prof.step().")
    figure = go.Figure(_line(steps, "step", "loss", "loss"))
    finite = np.isfinite(steps["loss"].to_numpy(dtype=float))
    if not finite.all():
        top = float(steps["loss"][finite].max()) if finite.any() else 0.0
        bad_steps = steps["step"][~finite]
        figure.add_trace(_markers(bad_steps, [top] * len(bad_steps), "non-finite loss", "crimson"))
    return Panel("Loss", _layout(figure, x_title="step", y_title="loss"))


def _elapsed(system: pd.DataFrame, start_unix_s: float | None) -> pd.DataFrame:
    origin = start_unix_s if start_unix_s else system["time_unix_s"].min()
    return system.assign(elapsed_s=system["time_unix_s"] - origin)


_GPU_ROWS = (
    ("utilization %", ("gpu_util_pct", "sm_active_pct", "tensor_active_pct")),
    ("power W", ("power_w",)),
    ("temperature °C", ("temp_c",)),
    ("SM clock MHz", ("sm_clock_mhz",)),
)
GPU_SERIES_NAMES = {"gpu_util_pct": "busy", "sm_active_pct": "SM active", "tensor_active_pct": "tensor cores active",
                    "power_w": "power", "temp_c": "temperature", "sm_clock_mhz": "SM clock"}


# The system columns the charts draw (not the throttle reasons: lists are slow to convert).
SYSTEM_CHART_COLUMNS = ("time_unix_s", "device_index", *(c for _, columns in _GPU_ROWS for c in columns),
                        "host_cpu_pct", "job_cpu_pct", "proc_rss_bytes")


def gpu_panel(system: pd.DataFrame, start_unix_s: float | None) -> Panel:
    title = "GPU utilization, SM activity, power, temperature, clocks"
    gpu = system[system["device_index"].notna()] if "device_index" in system.columns else system.iloc[0:0]
    rows = [(label, [c for c in columns if _has(gpu, c)]) for label, columns in _GPU_ROWS]
    rows = [(label, columns) for label, columns in rows if columns]
    if not rows:
        return Panel(title, None, "No GPU samples: this run did not run on a GPU (or NVML was unavailable).")
    gpu = _elapsed(gpu, start_unix_s)
    figure = make_subplots(rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                           subplot_titles=[label for label, _ in rows])
    for row, (_, columns) in enumerate(rows, start=1):
        for device, samples in gpu.groupby("device_index"):
            for column in columns:
                figure.add_trace(_line(samples, "elapsed_s", column, f"GPU {int(device)} {GPU_SERIES_NAMES[column]}"),
                                 row=row, col=1)
    _layout(figure, x_title="", height=170 * len(rows) + 60).update_layout(legend=LEGEND_BESIDE)
    _seconds_axis(figure)
    figure.update_xaxes(title_text="seconds since start", row=len(rows), col=1)
    return Panel(title, figure)


def _seconds_axis(figure: go.Figure) -> None:
    """Seconds since start, ticks and hover in one number format."""
    figure.update_xaxes(tickformat=",.0f", hoverformat=",.1f")


def host_panel(system: pd.DataFrame, start_unix_s: float | None) -> Panel:
    if not (_has(system, "host_cpu_pct") or _has(system, "proc_rss_bytes")):
        return Panel("Host CPU and memory", None, "No host samples recorded.")
    host = _elapsed(system, start_unix_s)
    figure = make_subplots(specs=[[{"secondary_y": True}]])
    if _has(host, "host_cpu_pct"):
        figure.add_trace(_line(host, "elapsed_s", "host_cpu_pct", "host CPU %"), secondary_y=False)
    if _has(host, "job_cpu_pct"):
        figure.add_trace(_line(host, "elapsed_s", "job_cpu_pct", "this run's CPU % (the rest: other processes)"),
                         secondary_y=False)
    if _has(host, "proc_rss_bytes"):
        figure.add_trace(_line(host, "elapsed_s", "proc_rss_bytes", "process RSS GiB", scale=1 / GIB), secondary_y=True)
        figure.update_yaxes(title_text="GiB", secondary_y=True)
    figure.update_yaxes(title_text="CPU %", secondary_y=False)
    _seconds_axis(figure)
    return Panel("Host CPU and memory", _layout(figure, x_title="seconds since start"))


def _memory_limit_bytes(meta: dict) -> float | None:
    sizes = [d.get("total_memory_bytes") for d in meta.get("devices") or [] if d.get("kind") == "cuda"]
    sizes = [size for size in sizes if size]
    return float(min(sizes)) if sizes else None


_MEMORY_LINES = (
    ("mem_allocated_bytes", "allocated"),
    ("mem_reserved_bytes", "reserved"),
    ("mem_peak_allocated_bytes", "peak allocated"),
)


def memory_panel(steps: pd.DataFrame, meta: dict) -> Panel:
    lines = [(column, name) for column, name in _MEMORY_LINES if _has(steps, column)]
    if not lines:
        if _has(steps, "mem_rss_bytes"):
            figure = go.Figure(_line(steps, "step", "mem_rss_bytes", "process RSS", scale=1 / GIB))
            return Panel("Memory", _layout(figure, x_title="step", y_title="GiB"),
                         "No device memory on this run (CPU): showing the process's resident memory.")
        return Panel("Memory", None, "No memory recorded.")
    figure = go.Figure([_line(steps, "step", column, name, scale=1 / GIB) for column, name in lines])
    limit = _memory_limit_bytes(meta)
    if limit:
        figure.add_hline(y=limit / GIB, line=dict(color="crimson", dash="dash"),
                         annotation_text=f"limit {limit / GIB:.1f} GiB")
    return Panel("Memory", _layout(figure, x_title="step", y_title="GiB"))


def grad_norm_heatmap_panel(layers: pd.DataFrame, steps: pd.DataFrame) -> Panel:
    """Layers by step; `steps` say which steps' gradients went non-finite (their layers are marked)."""
    title = "Gradient norm per layer (log10)"
    if layers.empty or not _has(layers, "grad_norm"):
        return Panel(title, None, "No per-layer gradient norms recorded (pass model= to gpuprof.profile).")
    order = sorted(layers["layer"].unique(), key=_natural)  # h.2 before h.10
    table = layers.pivot_table(index="step", columns="layer", values="grad_norm", aggfunc="mean",
                              dropna=False)[order]  # a step whose every norm is NaN keeps its column
    averaged = bucket_mean(table.reset_index(), "step", order, HEATMAP_MAX_STEPS)
    norms = averaged[order].to_numpy(dtype=float).T
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.log10(norms)
    z[~np.isfinite(z)] = np.nan
    step_labels = averaged["step"].astype(str)  # one cell per recorded step, however few or far apart
    figure = go.Figure(go.Heatmap(x=step_labels, y=order, z=z, colorscale="Viridis", colorbar=dict(title="log10 ‖g‖")))
    bad = _nonfinite_layer_cells(layers, steps)
    if not bad.empty:
        figure.add_trace(go.Scatter(x=bad["step"].astype(str), y=bad["layer"], mode="markers", name="non-finite",
                                    marker=dict(color="crimson", symbol="x", size=8)))
    figure.update_xaxes(type="category")
    figure.update_yaxes(type="category", tickmode="array", tickvals=order, ticktext=_short_names(order),
                        tickfont=dict(size=10), autorange="reversed")
    figure.update_layout(hovermode="closest")
    recorded = np.sort(layers["step"].unique())
    every = f"every {int(np.diff(recorded).min())} steps" if len(recorded) > 1 else f"at step {int(recorded[0])} only"
    note = (f"Per-layer norms are recorded {every} (gpuprof.profile(layer_interval=N)); a white cell is a norm that "
            "was not finite" + (", marked ✕ on the steps whose gradients went non-finite." if not bad.empty else "."))
    return Panel(title, _layout(figure, x_title="step", height=max(CHART_HEIGHT_PX, 14 * len(order) + 80)), note)


def _natural(name: str) -> list:
    """A sort key that orders the numbers inside names as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def _nonfinite_layer_cells(layers: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """(step, layer) of the layers whose gradient norm is not finite, on the steps whose gradients went
    non-finite (elsewhere an empty norm is one not measured)."""
    if "grad_norm_finite" not in steps.columns:
        return layers.iloc[0:0]
    bad_steps = steps.loc[steps["grad_norm_finite"].eq(False), "step"]
    norms = layers["grad_norm"].to_numpy(dtype=float)
    return layers.loc[layers["step"].isin(bad_steps) & ~np.isfinite(norms), ["step", "layer"]]


def _short_names(names: list[str]) -> list[str]:
    """Dotted names without the prefix they all share ("transformer.h.0.attn" -> "h.0.attn")."""
    split = [name.split(".") for name in names]
    shared = 0
    while len(names) > 1 and all(len(parts) > shared + 1 for parts in split) and len({parts[shared] for parts in split}) == 1:
        shared += 1
    return [".".join(parts[shared:]) for parts in split]


def scaler_panel(steps: pd.DataFrame) -> Panel:
    title = "GradScaler scale and skipped steps"
    if not _has(steps, "scaler_scale"):
        return Panel(title, None, "No GradScaler in this run.")
    figure = go.Figure(_line(steps, "step", "scaler_scale", "scale"))
    if "step_skipped" in steps.columns:
        skipped = steps[steps["step_skipped"].fillna(False).astype(bool)]
        if not skipped.empty:
            figure.add_trace(_markers(skipped["step"], skipped["scaler_scale"], "skipped step", "crimson"))
    figure.update_yaxes(type="log")
    return Panel(title, _layout(figure, x_title="step", y_title="scale"))


def run_panels(run, rank: int) -> list[Panel]:
    """The Run page's charts for one rank, in page order (only that rank's files are read)."""
    steps, layers = (run.query.rank_frame(stream, rank) for stream in ("steps", "layers"))
    system = run.query.rank_frame("system", rank, SYSTEM_CHART_COLUMNS)
    start = run.meta.get("start_unix_s")
    if steps.empty:
        return [Panel("Steps", None, "No steps recorded yet.")]
    return [
        throughput_panel(steps),
        phases_panel(steps),
        loss_panel(steps),
        gpu_panel(system, start),
        host_panel(system, start),
        memory_panel(steps, run.meta),
        grad_norm_heatmap_panel(layers, steps),
        scaler_panel(steps),
    ]


# Why the step-time grid of a data-parallel run is one colour down each column: not a defect.
STEP_TIME_ACROSS_RANKS = ("Ranks wait for each other at every collective, so a step takes about as long on every "
                          "rank: a straggler shows in the phase shares (pick one above) and in own work per step.")
RANK_HEATMAPS = {"step time": ("step_time_s", None), **{f"{p} share": (f"{p}_time_s", "step_time_s") for p in SPLIT_PHASES}}


def rank_heatmap_panels(query) -> dict[str, Panel]:
    """Rank x step heatmaps of step time and of each phase's share of it, downsampled by the query
    engine to at most HEATMAP_MAX_RANKS x HEATMAP_MAX_STEPS cells: a straggler is a bright row."""
    grid = query.grid("steps", RANK_HEATMAPS, max_ranks=HEATMAP_MAX_RANKS, max_steps=HEATMAP_MAX_STEPS)
    return {name: _rank_heatmap(grid, name) for name in RANK_HEATMAPS}


def _rank_heatmap(grid: pd.DataFrame, name: str) -> Panel:
    title = f"{name.capitalize()} per rank and step"
    if grid.empty or grid[name].isna().all():
        return Panel(title, None, f"No {name} recorded.")
    scale, unit = (1e3, "ms") if name == "step time" else (100.0, "%")
    table = grid.pivot_table(index="rank_first", columns="step_first", values=name, aggfunc="first", dropna=False)
    last_rank = grid.groupby("rank_first")["rank_last"].max()
    labels = [f"rank {r}" if last_rank[r] == r else f"ranks {r}-{last_rank[r]}" for r in table.index]
    figure = go.Figure(go.Heatmap(x=table.columns, y=labels, z=table.to_numpy(dtype=float) * scale,
                                  colorscale="Viridis", colorbar=dict(title=unit)))
    figure.update_yaxes(autorange="reversed", type="category")
    note = STEP_TIME_ACROSS_RANKS if name == "step time" and len(labels) > 1 else ""
    if len(table.columns) < grid["step_last"].max() - grid["step_first"].min() + 1 or len(labels) < last_rank.max() + 1:
        note = " ".join([note, "Averaged over cells of neighbouring steps and ranks (downsampled for display)."]).strip()
    return Panel(title, _layout(figure, x_title="step", height=max(CHART_HEIGHT_PX, min(3 * len(labels), 800) + 80)),
                 note)


def rank_detail_panels(query, rank: int) -> list[Panel]:
    """One rank's step time beside the run's (the slowest rank's, which every rank waits for, and
    the mean over ranks), then its phases: read from that rank's file alone."""
    steps = query.rank_frame("steps", rank)
    if steps.empty:
        return [Panel(f"Rank {rank}", None, f"Rank {rank} recorded no steps (missing or unreadable).")]
    run = pd.DataFrame({"slowest": query.step_series("step_time_s", "max"),
                        "mean": query.step_series("step_time_s", "mean")}).rename_axis("step").reset_index()
    figure = go.Figure([
        _line(steps, "step", "step_time_s", f"rank {rank}", scale=1e3),
        _line(run, "step", "slowest", "slowest rank", scale=1e3, line=dict(dash="dot")),
        _line(run, "step", "mean", "mean over ranks", scale=1e3, line=dict(dash="dash")),
    ])
    return [Panel(f"Step time of rank {rank}", _layout(figure, x_title="step", y_title="ms")), phases_panel(steps)]


OUTCOME_SYMBOLS = {"finished": ("circle", "seagreen"), "failed": ("x", "crimson"), "incomplete": ("square", "black"),
                   "running": ("triangle-right", "gray")}
TIMELINE_BEATS_PER_RANK = 400


def rank_timeline_panel(heartbeats: pd.DataFrame, hangs: pd.DataFrame, outcomes: pd.DataFrame,
                        start_unix_s: float | None) -> Panel:
    """Every rank's heartbeats over time (colour: its phase; hover: step, collective, where), its `hang`
    events, and where each rank's record ends (finished, failed, incomplete)."""
    title = "Ranks over time: heartbeats, hangs, ends"
    if heartbeats.empty and hangs.empty:
        return Panel(title, None, "No heartbeats recorded (the hang watchdog was off, or the run ended within a beat).")
    origin = start_unix_s or heartbeats["time_unix_s"].min()
    figure = go.Figure()
    beats = pd.concat([_thin(group, TIMELINE_BEATS_PER_RANK) for _, group in heartbeats.groupby("rank")]) \
        if not heartbeats.empty else heartbeats
    for phase, group in beats.groupby(beats["phase"].fillna("other")) if not beats.empty else ():
        text = [f"step {s}, {p}" + (f", in {k} #{q}" if isinstance(k, str) else "") + (f"<br>{w}" if isinstance(w, str) else "")
                for s, p, k, q, w in zip(group["step"], group["phase"], group["collective_kind"],
                                         group["collective_seq"], group["where"])]
        figure.add_trace(go.Scatter(x=group["time_unix_s"] - origin, y=group["rank"].map("rank {}".format),
                                    mode="markers", name=str(phase), text=text, hoverinfo="text+x",
                                    marker=dict(size=7, color=PHASE_COLORS.get(phase, "#17becf"))))
    if not hangs.empty:
        figure.add_trace(go.Scatter(x=hangs["time_unix_s"] - origin, y=hangs["rank"].map("rank {}".format),
                                    mode="markers", name="hang", text=hangs["message"], hoverinfo="text+x",
                                    marker=dict(size=14, symbol="x-thin-open", color="crimson", line=dict(width=3))))
    ended = outcomes.dropna(subset=["last_seen_unix_s"]) if not outcomes.empty else outcomes
    for status, group in ended.groupby("status") if not ended.empty else ():
        symbol, color = OUTCOME_SYMBOLS.get(status, ("circle", "gray"))
        figure.add_trace(go.Scatter(x=group["last_seen_unix_s"] - origin, y=group["rank"].map("rank {}".format),
                                    mode="markers", name=f"last seen: {status}", hoverinfo="name+x",
                                    marker=dict(size=12, symbol=symbol, color=color)))
    figure.update_yaxes(type="category", autorange="reversed")
    figure.update_layout(hovermode="closest")
    ranks = int(outcomes["rank"].nunique()) if not outcomes.empty else int(heartbeats["rank"].nunique())
    return Panel(title, _layout(figure, x_title="seconds since start", height=max(CHART_HEIGHT_PX, min(24 * ranks, 800) + 80)))


def _thin(frame: pd.DataFrame, most: int) -> pd.DataFrame:
    """At most `most` rows, evenly spaced, the last kept (a rank's last beat is where it stopped)."""
    if len(frame) <= most:
        return frame
    keep = np.unique(np.linspace(0, len(frame) - 1, most).round().astype(int))
    return frame.iloc[keep]


def rank_phase_panel(per_rank: pd.DataFrame) -> Panel:
    """Median time of each phase per rank, stacked (from the run summary's per-rank table)."""
    phases = [phase for phase in SPLIT_PHASES if _has(per_rank, f"{phase}_time_p50_s")]
    if per_rank.empty or not phases:
        return Panel("Phases per rank (median)", None, "No phase times recorded.")
    labels = [f"rank {int(rank)}" for rank in per_rank["rank"]]
    figure = go.Figure([go.Bar(x=labels, y=per_rank[f"{phase}_time_p50_s"] * 1e3, name=phase,
                               marker_color=PHASE_COLORS[phase]) for phase in phases])
    figure.update_layout(barmode="stack")
    return Panel("Phases per rank (median)", _layout(figure, x_title="", y_title="ms"))


def overlay_panel(runs: dict[str, pd.DataFrame], column: str, title: str, y_title: str, scale: float = 1.0) -> Panel:
    """The same step series of several runs on one chart (Compare page)."""
    traces = [
        _line(steps, "step", column, name, scale=scale)
        for name, steps in runs.items() if _has(steps, column)
    ]
    if not traces:
        return Panel(title, None, f"Neither run recorded {column}.")
    return Panel(title, _layout(go.Figure(traces), x_title="step", y_title=y_title))


def step_time_distribution_panel(times_s: dict[str, np.ndarray]) -> Panel:
    """The measured step times of the compared runs, one histogram each on shared bins (Compare page, HTML)."""
    known = {name: values for name, values in times_s.items() if len(values)}
    if not known:
        return Panel("Measured step times", None, "Neither run has measured steps.")
    edges_ms = np.histogram_bin_edges(1e3 * np.concatenate(list(known.values())), bins=40)
    bins = dict(start=edges_ms[0], end=edges_ms[-1], size=(edges_ms[-1] - edges_ms[0]) / 40 or 1.0)
    traces = [go.Histogram(x=1e3 * values, name=name, xbins=bins, opacity=0.6) for name, values in known.items()]
    figure = go.Figure(traces).update_layout(barmode="overlay", hovermode="closest")
    return Panel("Measured step times", _layout(figure, x_title="step time (ms)", y_title="steps"))


KERNEL_NAME_CHARS = 60
TRACE_STEP_COLUMNS_EXCLUDED = ("rank", "step", "start_us", "end_us", "step_time_us")


def trace_steps_panel(step_breakdown: pd.DataFrame) -> Panel:
    """Each profiled step split into kernel, memcpy, communication, CPU... time (sums to the step's wall time)."""
    title = "Step time breakdown (trace window)"
    if step_breakdown.empty:
        return Panel(title, None, "No profiler steps in this trace (no ProfilerStep markers).")
    labels = [f"rank {int(r)} · step {int(s)}" for r, s in zip(step_breakdown["rank"], step_breakdown["step"])]
    columns = [c for c in step_breakdown.columns if c.endswith("_us") and c not in TRACE_STEP_COLUMNS_EXCLUDED]
    figure = go.Figure([
        go.Bar(x=labels, y=step_breakdown[column] / 1e3, name=column.removesuffix("_us")) for column in columns
    ])
    figure.update_layout(barmode="stack")
    return Panel(title, _layout(figure, x_title="", y_title="ms"))


def kernel_types_panel(kernel_types: pd.DataFrame) -> Panel:
    title = "Kernel time by type"
    if kernel_types.empty:
        return Panel(title, None, "No GPU kernels in this trace.")
    figure = go.Figure([
        go.Bar(y=frame["kernel_type"], x=frame["time_us"] / 1e3, name=f"rank {int(rank)}", orientation="h")
        for rank, frame in kernel_types.groupby("rank")
    ])
    figure.update_yaxes(automargin=True, autorange="reversed")
    return Panel(title, _layout(figure, x_title="ms"))


def top_kernels_panel(top_kernels: pd.DataFrame) -> Panel:
    """One bar per kernel of each rank, by its row (two kernels whose shortened names are alike stay two bars),
    labelled with its shortened name; the full name on hover."""
    title = "Top kernels by total time"
    if top_kernels.empty:
        return Panel(title, None, "No GPU kernels in this trace.")
    shown = top_kernels.sort_values("total_us").reset_index(drop=True)
    ids = [f"kernel {i}" for i in range(len(shown))]
    labels = [f"r{int(r)} {_short_kernel(name)}" for r, name in zip(shown["rank"], shown["name"])]
    figure = go.Figure(go.Bar(x=shown["total_us"] / 1e3, y=ids, orientation="h",
                              customdata=shown[["name", "count", "mean_us"]], hovertemplate=(
                                  "%{customdata[0]}<br>%{x:.2f} ms total, %{customdata[1]} calls, "
                                  "%{customdata[2]:.1f} µs mean<extra></extra>")))
    figure.update_yaxes(automargin=True, type="category", tickmode="array", tickvals=ids, ticktext=labels)
    return Panel(title, _layout(figure, x_title="ms", height=max(CHART_HEIGHT_PX, 26 * len(ids) + 80)))


def _short_kernel(name: str) -> str:
    return name if len(name) <= KERNEL_NAME_CHARS else name[:KERNEL_NAME_CHARS - 1] + "…"


def tune_trials_panel(trials: list[dict]) -> Panel:
    """Each measured trial's speedup over the baseline with its interval, its finding's estimate beside it."""
    from gpuprof.report.tuning import speedup_of, trial_label

    measured = [(trial_label(trial), speedup_of(trial), trial.get("estimate")) for trial in trials if trial.get("speedup")]
    title = "Measured speedup against the estimate"
    if not measured:
        return Panel(title, None, "No trial was measured.")
    labels = [label for label, _, _ in measured]
    points = [speedup.point for _, speedup, _ in measured]
    figure = go.Figure([
        go.Scatter(x=points, y=labels, mode="markers", name="measured (95 % CI)", marker=dict(size=10),
                   error_x=dict(type="data", symmetric=False,
                                array=[speedup.high - speedup.point for _, speedup, _ in measured],
                                arrayminus=[speedup.point - speedup.low for _, speedup, _ in measured])),
        go.Scatter(x=[estimate for _, _, estimate in measured], y=labels, mode="markers", name="the finding's estimate",
                   marker=dict(symbol="diamond-open", size=12)),
    ])
    figure.add_vline(x=1.0, line_dash="dot")  # the baseline, as the axis title says: a label there would sit on a row
    figure.update_layout(hovermode="closest")
    height = max(CHART_HEIGHT_PX // 2, 60 + 40 * len(measured))
    return Panel(title, _layout(figure, x_title="speedup over the baseline (×, right of the dotted 1× is faster)", height=height))


def trace_memory_panel(memory_timeline: pd.DataFrame) -> Panel:
    """Allocated and reserved memory over a trace (profile_memory=True), per rank and device."""
    title = "Memory over time"
    if memory_timeline.empty:
        return Panel(title, None, "No memory events in this trace (record with profile_memory=True).")
    figure = go.Figure()
    for (rank, device), frame in memory_timeline.groupby(["rank", "device"]):
        for column in ("allocated_bytes", "reserved_bytes"):
            if _has(frame, column):
                figure.add_scatter(x=frame["ts_us"] / 1e3, y=frame[column] / 2**20, mode="lines",
                                   name=f"{column.removesuffix('_bytes')} · rank {int(rank)} {device}")
    return Panel(title, _layout(figure, x_title="ms since the trace's start", y_title="MiB"),
                 "The highest point of each time slice, so the peak is always drawn.")
