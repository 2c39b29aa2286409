"""Numbers and labels for people: the one formatting of `gpuprof analyze`/`compare`, the HTML
report and the dashboard. Figures carry their unit in their name; these put it in the text.
No heavy imports: the CLI loads this module before it knows what it will print."""

from __future__ import annotations

import math
import re

from gpuprof.units import bytes_text

GIB = 2**30
MISSING = "n/a"
# A field name's unit ending as people read it, the value left in that unit (evidence, event details).
FIELD_UNITS = (("_per_s", "/s"), ("_us", " µs"), ("_s", " s"), ("_pct", " %"), ("_bytes", " bytes"))
# A severity's colour: by name (Streamlit's markdown colours) and as hex (the HTML report).
SEVERITY_COLORS = {"critical": ("red", "#c62828"), "warning": ("orange", "#ef6c00"), "info": ("blue", "#1565c0")}
# Fixes and verdicts name code as markdown's `code spans`; a page shows them as code, never the backticks.
CODE_SPAN = re.compile(r"(`[^`]+`)")


def known(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def fmt(value, pattern: str = "{:,.3g}") -> str:
    return pattern.format(value) if known(value) else MISSING


def fmt_ms(value_s) -> str:
    return fmt(value_s * 1e3 if known(value_s) else None, "{:,.1f} ms")


def fmt_pct(fraction) -> str:
    """A fraction 0-1 (MFU) as a percentage."""
    return fmt(fraction * 100 if known(fraction) else None, "{:.1f} %")


def fmt_share(value_pct) -> str:
    """A share already in percent (phase shares, the verdict's share)."""
    return fmt(value_pct, "{:.0f} %")


def fmt_ratio(value) -> str:
    return fmt(value, "{:.2f}×")


def table_number(value, milliseconds: bool = False) -> str:
    """A number in a text table: whole numbers with thousands separators, others to 2 decimals;
    `milliseconds`, a time in µs shown in ms (3 decimals below 1 ms, else 1)."""
    if not known(value):
        return MISSING
    if milliseconds:
        return f"{value / 1000:,.3f}" if abs(value) < 1000 else f"{value / 1000:,.1f}"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.2f}"


def figure(value, unit: str = "") -> str:
    """A figure with its unit: 3 significant digits, binary prefixes for bytes, ms below a second."""
    if not known(value):
        return MISSING
    if unit == "s" and abs(value) < 1:
        return f"{1000 * value:.3g} ms"
    if unit == "bytes":
        return bytes_text(value)
    if unit == "%":
        return f"{value:.1f} %"
    if isinstance(value, float):
        text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
        return f"{text} {unit}".rstrip()
    return f"{value} {unit}".rstrip()


def figure_text(value, unit: str = "") -> str:
    """`figure`, and the units of a comparison: "×" (a ratio), "pp" (a difference of percentages),
    "rel" (a relative difference, shown in percent) and "fraction" (0-1, shown in percent, MFU)."""
    if not known(value):
        return MISSING
    if unit == "×":
        return f"{value:.2f}×"
    if unit == "pp":
        return f"{value:+.1f} pp"
    if unit == "rel":
        return f"{100 * value:+.1f} %"
    if unit == "fraction":
        return f"{100 * value:.1f} %"
    if unit == "%" and abs(value) < 1:
        return f"{value:.2f} %"
    return figure(value, unit)


def fmt_interval(value, unit: str = "", *, brief: bool = False) -> str:
    """A figure and its confidence interval: "101 ms (95 % CI 99.7–102 ms)", or "101 ms [99.7–102 ms]"
    when `brief` (a table that says its confidence once); a plain number as `figure_text` (a
    figure that is not a mean over steps has no interval)."""
    if not hasattr(value, "low"):
        return figure_text(value, unit)
    bounds = range_text(value.low, value.high, unit)
    if brief:
        return f"{figure_text(value.point, unit)} [{bounds}]"
    return f"{figure_text(value.point, unit)} ({ci_text(value, unit)})"


def ci_text(interval, unit: str = "") -> str:
    """"95 % CI 1.31–1.55×"."""
    return f"{100 * interval.confidence:.0f} % CI {range_text(interval.low, interval.high, unit)}"


def range_text(low: float, high: float, unit: str = "") -> str:
    """"1.31–1.55×", the unit once where both ends share it."""
    low_text, high_text = figure_text(low, unit), figure_text(high, unit)
    suffix = high_text.lstrip("+-0123456789.,")
    if suffix and low_text.endswith(suffix) and low_text != suffix:
        low_text = low_text[: -len(suffix)]
    return f"{low_text}{' to ' if low < 0 else '–'}{high_text}"


def fmt_ratio_interval(interval) -> str:
    """"1.42× (95 % CI 1.31–1.55×)"."""
    return fmt_interval(interval, "×")


def rank_list(ranks, shown: int = 20) -> str:
    """"3, 7, 21", or past `shown` ranks "0, 1, …, 19 and 44 more" (one wording on every page and line)."""
    ranks = list(ranks)
    text = ", ".join(map(str, ranks[:shown]))
    return text + (f" and {len(ranks) - shown} more" if len(ranks) > shown else "")


def short_labels(names: list[str], width: int) -> dict[str, str]:
    """Each name as it fits `width` characters and still tells it from the others: a longer one as "…" and
    its shortest end (from a "-", "_" or "/") that no other name ends in ("…tiny-baseline")."""
    return {name: _short_label(name, names, width) for name in names}


def _short_label(name: str, names: list[str], width: int) -> str:
    """`name` whole when it fits or when no shorter end tells it apart."""
    if len(name) <= width:
        return name
    ends = [name[i + 1:] for i in reversed(range(len(name))) if name[i] in "-_/"]
    unique = (end for end in ends if not any(other != name and other.endswith(end) for other in names))
    return next((f"…{end}" for end in unique), name)


def field_text(name) -> str:
    """A snake_case field (an evidence key) as words, its unit ending as a symbol: "stall_time_s" -> "stall time s";
    another key (a rank) as its text."""
    name = str(name)
    for ending, symbol in FIELD_UNITS:
        if name.endswith(ending):
            return name.removesuffix(ending).replace("_", " ") + symbol
    return name.replace("_", " ")


def code_parts(text: str) -> list[tuple[str, bool]]:
    """`text` in pieces, each with whether it is code (a code span, its backticks dropped)."""
    return [(part[1:-1], True) if CODE_SPAN.fullmatch(part) else (part, False) for part in CODE_SPAN.split(text) if part]


def present(mapping: dict) -> dict:
    """The entries of `mapping` that hold something: no None, NaN, empty text, list or dict."""
    return {key: value for key, value in mapping.items() if known(value) and not (
        isinstance(value, (str, list, tuple, dict)) and len(value) == 0)}


def value_text(value) -> str:
    """An evidence or event value: whole floats as integers, others to 4 significant digits; a dict as its
    entries that hold something."""
    if isinstance(value, dict):
        return ", ".join(f"{key}={value_text(item)}" for key, item in present(value).items())
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else fmt(value, "{:.4g}")
    if isinstance(value, (list, tuple)):
        return ", ".join(map(value_text, value))
    return MISSING if value is None else str(value)


# A finding's evidence line in the terminal: the figures that fit this width (the whole line), in the order its rule
# gives them; --json holds every key.
EVIDENCE_WIDTH = 140
# Evidence a line leaves to --json: the rule's own settings, not what it measured.
SETTING_PREFIX = "threshold_"
# Above this, a count or rate reads with a decimal prefix ("989 T/s").
DECIMAL_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"))


def evidence_line(evidence: dict, width: int) -> str:
    """The evidence's measured figures as people read them ("data share: 70.9 %; step time p50: 1.41 s"), in the
    rule's order as far as they fit `width` characters, and how many more --json holds."""
    shown: list[str] = []
    for key, value in present(evidence).items():
        if str(key).startswith(SETTING_PREFIX):
            continue
        item = evidence_item(key, value)
        if len("; ".join([*shown, item])) + len(_more_text(len(evidence) - len(shown) - 1)) > width:
            break
        shown.append(item)
    return "; ".join(shown) + _more_text(len(evidence) - len(shown))


def _more_text(left: int) -> str:
    return f" (+{left} more in --json)" if left > 0 else ""


def evidence_item(key, value) -> str:
    """One evidence entry: its key as words, its value in the unit its key names ("stall_time_s" -> "stall time:
    120 ms", "lag_pct_of_step" -> "lag of step: 70.2 %"); a dict's values (per rank, per op) in that unit too."""
    words, unit = _words_and_unit(str(key))
    if isinstance(value, dict):
        text = ", ".join(f"{_name_text(name)} {_unit_value(item, unit)}" for name, item in present(value).items())
    else:
        text = _unit_value(value, unit)
    return f"{words}: {text}"


# The unit words of a key (FIELD_UNITS' endings as they sit anywhere in it: "lag_pct_of_step").
UNIT_WORDS = {("per", "s"): "_per_s", ("us",): "_us", ("s",): "_s", ("pct",): "_pct", ("bytes",): "_bytes"}


def _words_and_unit(key: str) -> tuple[str, str]:
    words = key.split("_")
    for unit_words, ending in UNIT_WORDS.items():
        for at in range(len(words) - len(unit_words), 0, -1):
            if tuple(words[at:at + len(unit_words)]) == unit_words:
                return " ".join(words[:at] + words[at + len(unit_words):]), ending
    return " ".join(words), ""


def _name_text(name) -> str:
    """A key inside an evidence value: a field ("module") as words, anything else (an op, a rank) as it is."""
    name = str(name)
    return field_text(name) if re.fullmatch(r"[a-z][a-z0-9_]*", name) else name


def _unit_value(value, ending: str) -> str:
    """A value in the unit of its key's `ending` (FIELD_UNITS); without one, as `value_text` writes it."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, (int, float)) or not known(value):
        return value_text(value)
    if ending == "_s":
        return figure(value, "s")
    if ending == "_us":
        return f"{figure(value)} µs"
    if ending == "_pct":
        return f"{figure(value)} %"
    if ending == "_bytes":
        return bytes_text(value)
    return f"{_count_text(value)}/s" if ending == "_per_s" else _count_text(value)


def _count_text(value) -> str:
    """A count or a rate: with a decimal prefix from a million on ("989 T"), else as `figure` writes it."""
    for scale, symbol in DECIMAL_PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {symbol}"
    return figure(value)


def gain_text(est_gain_pct) -> str:
    """A finding's expected gain, or "" when its rule cannot estimate one."""
    return f"est. gain {fmt_share(est_gain_pct)} of step time" if known(est_gain_pct) else ""


def device_label(meta: dict) -> str:
    """E.g. "cpu", "cuda: NVIDIA H100 80GB HBM3", "2 × cuda: ..."."""
    devices = meta.get("devices") or []
    if not devices:
        return "unknown"
    first = devices[0]
    label = first.get("kind") or "unknown"
    if first.get("kind") == "cuda" and first.get("name"):
        label = f"cuda: {first['name']}"
    count = max(len(devices), int(meta.get("world_size") or 1))
    return f"{count} × {label}" if count > 1 else label


def model_label(meta: dict) -> str:
    """The workload's model size, else the model's class."""
    return (meta.get("config") or {}).get("model_size") or (meta.get("model") or {}).get("class") or MISSING


def workload_label(meta: dict) -> str:
    """The model and, for the reference workload, its variant: "tiny baseline", "GPT2LMHeadModel"."""
    variant = (meta.get("config") or {}).get("variant")
    return f"{model_label(meta)} {variant}" if variant else model_label(meta)


def headline_figures(summary) -> dict[str, str]:
    """A run's headline figures as people read them: the Run page's metrics, the HTML report's table."""
    return {
        "Step time p50": fmt_ms(summary.step_time_p50_s),
        "Tokens/s": fmt(summary.tokens_per_s, "{:,.0f}"),
        "MFU": fmt_pct(summary.mfu),
        "Peak memory": figure(summary.peak_memory_bytes, "bytes"),
        "GPU utilization": fmt_share(summary.gpu_util_mean_pct),
    }
