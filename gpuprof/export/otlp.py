"""A recorded run as OpenTelemetry traces, sent to an OTLP endpoint (Jaeger, Tempo, Honeycomb, an OTel collector)
with the OpenTelemetry SDK: per rank, one span for the run and one child span per optimizer step.

A step's span lasts from the step's start to its end (`time_unix_s` less `step_time_s`, to `time_unix_s`) and carries
every number and flag of its steps row as a `gpuprof.<column>` attribute; the run's events are span events, on their
step's span (the run's span for events of no step); the run's span carries the verdict. Trace and span ids are drawn
from a generator seeded with the run's id and the rank, so exporting the same run again sends the same ids.
"""

from __future__ import annotations

import hashlib
import logging
import random

import pandas as pd

from gpuprof.errors import GpuprofError
from gpuprof.export.rows import of_rank
from gpuprof.report import build_report
from gpuprof.run import schema
from gpuprof.run.jsonable import json_safe

SERVICE_NAME = "gpuprof"
NS_PER_S = 1_000_000_000
ENDPOINT_TIMEOUT_S = 10.0


def export_otlp(run_dir, endpoint: str | None = None) -> int:
    """Sends the run's spans to `endpoint` (None: the OTLP exporter's own default, OTEL_EXPORTER_OTLP_ENDPOINT or
    localhost); returns how many were sent. GpuprofError when the endpoint does not take them."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import SpanExportResult
    except ImportError:
        raise GpuprofError("the OTLP export needs the OpenTelemetry SDK: pip install 'gpuprof[otlp]'") from None
    spans = run_spans(run_dir)
    exporter = OTLPSpanExporter(endpoint=endpoint, timeout=ENDPOINT_TIMEOUT_S)
    exporter_log = logging.getLogger("opentelemetry.exporter.otlp")  # its retries: our one line says the outcome
    level = exporter_log.level
    exporter_log.setLevel(logging.CRITICAL)
    try:
        result = exporter.export(spans)
    finally:
        exporter_log.setLevel(level)
        exporter.shutdown()
    if result is not SpanExportResult.SUCCESS:
        raise GpuprofError(f"the OTLP endpoint {endpoint or 'configured by OTEL_EXPORTER_OTLP_ENDPOINT'} did not "
                           f"take the {len(spans)} spans (is a collector listening there?)")
    return len(spans)


def run_spans(run_dir) -> list:
    """The run's spans, finished and ready for any OpenTelemetry span exporter, rank by rank."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    report = build_report(run_dir)
    run = report.run
    spans = []
    for rank in run.ranks or [0]:
        collected = InMemorySpanExporter()  # one per provider: its shutdown stops the exporter too
        provider = TracerProvider(
            resource=Resource.create({"service.name": SERVICE_NAME, "gpuprof.run": run.name, "gpuprof.rank": rank}),
            id_generator=_seeded_ids(f"{run.meta.get('run_id') or run.name}/{rank}"), shutdown_on_exit=False)
        provider.add_span_processor(SimpleSpanProcessor(collected))
        steps, events = of_rank(run.steps, rank), of_rank(run.events, rank)
        _rank_spans(provider.get_tracer("gpuprof.export"), report, rank, steps, events)
        provider.shutdown()
        spans += collected.get_finished_spans()
    return spans


def _rank_spans(tracer, report, rank: int, steps: pd.DataFrame, events: pd.DataFrame) -> None:
    from opentelemetry import trace

    starts_ns = _ns(steps["time_unix_s"] - steps["step_time_s"]) if not steps.empty else []
    ends_ns = _ns(steps["time_unix_s"]) if not steps.empty else []
    run_start = min(starts_ns, default=_ns_one(report.meta.get("start_unix_s")))
    run_end = max(ends_ns, default=run_start)
    events_by_step = {step: group for step, group in events.groupby("step")} if not events.empty else {}
    verdict = report.verdict
    root = tracer.start_span(f"run {report.name}", start_time=run_start, attributes={
        "gpuprof.rank": rank, "gpuprof.verdict": verdict.headline, "gpuprof.verdict.why": verdict.why,
        "gpuprof.verdict.next_step": verdict.next_step})
    context = trace.set_span_in_context(root)
    columns = [column for column in schema.measured_columns("steps") if column in steps]
    for row, start_ns, end_ns in zip(steps.to_dict(orient="records"), starts_ns, ends_ns):
        attributes = {f"gpuprof.{column}": value for column in columns
                      if (value := json_safe(row[column], digits=None)) is not None}
        span = tracer.start_span("step", context=context, start_time=start_ns,
                                 attributes={"gpuprof.step": int(row["step"]), "gpuprof.rank": rank, **attributes})
        _add_events(span, events_by_step.get(row["step"]))
        span.end(end_time=end_ns)
    _add_events(root, events[events["step"].isna()] if not events.empty else None)
    root.end(end_time=run_end)


def _add_events(span, events: pd.DataFrame | None) -> None:
    for row in (events.to_dict(orient="records") if events is not None else []):
        span.add_event(str(row["kind"]), timestamp=_ns_one(row["time_unix_s"]),
                       attributes={"gpuprof.severity": str(row["severity"]), "gpuprof.message": str(row["message"])})


def _seeded_ids(seed: str):
    """An id generator that draws the same ids, in the same order, for the same run and rank."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class SeededIds(IdGenerator):
        def __init__(self):
            self._random = random.Random(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big"))

        def generate_span_id(self) -> int:
            return self._random.getrandbits(64) or 1

        def generate_trace_id(self) -> int:
            return self._random.getrandbits(128) or 1

    return SeededIds()


def _ns(seconds: pd.Series) -> list[int]:
    return [int(value * NS_PER_S) for value in seconds]


def _ns_one(seconds) -> int:
    return int(float(seconds) * NS_PER_S) if seconds is not None and pd.notna(seconds) else 0
