"""`gpuprof export RUN --to otlp`: a run's steps as OpenTelemetry spans, sent over OTLP/HTTP and decoded by
OpenTelemetry's own protobuf messages on the receiving side, as a collector would."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from processes import free_port, gpuprof_cli

import gpuprof
from gpuprof.export.otlp import run_spans
from gpuprof.run.schema import measured_columns

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "ddp-2rank"


class Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP traces endpoint that keeps what it was sent."""

    received: list[ExportTraceServiceRequest] = []

    def do_POST(self):  # noqa: N802 - http.server's API
        request = ExportTraceServiceRequest()
        request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        Receiver.received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    Receiver.received = []
    server = http.server.HTTPServer(("127.0.0.1", free_port()), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    server.shutdown()


def test_every_step_of_every_rank_arrives_as_a_span_with_its_values_under_its_ranks_run_span(receiver):
    done = gpuprof_cli("export", str(SAMPLE), "--to", "otlp", "--endpoint", receiver)
    assert done.returncode == 0, done.stderr
    spans = [(resource.resource, span) for request in Receiver.received for resource in request.resource_spans
             for scope in resource.scope_spans for span in scope.spans]
    run = gpuprof.load_run(SAMPLE)
    assert len(spans) == len(run.steps) + len(run.ranks) and f"sent {len(spans)} spans" in done.stdout
    for rank in run.ranks:
        ours = [span for resource, span in spans
                if {a.key: a.value.int_value for a in resource.attributes}.get("gpuprof.rank") == rank]
        [root] = [span for span in ours if span.name.startswith("run ")]
        steps = run.steps[run.steps["rank"] == rank].set_index("step")
        step_spans = [span for span in ours if span.name == "step"]
        assert len(step_spans) == len(steps)
        for span in step_spans:
            attributes = {a.key: a.value for a in span.attributes}
            row = steps.loc[attributes["gpuprof.step"].int_value]
            assert span.parent_span_id == root.span_id and span.trace_id == root.trace_id
            assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(row["step_time_s"], abs=1e-6)
            for column in measured_columns("steps"):
                if column in row and row[column] is not None and row[column] == row[column]:
                    value = attributes[f"gpuprof.{column}"]
                    got = value.double_value if value.HasField("double_value") else (
                        value.bool_value if value.HasField("bool_value") else value.int_value)
                    assert got == pytest.approx(row[column])
        verdict = {a.key: a.value.string_value for a in root.attributes}["gpuprof.verdict"]
        assert verdict == gpuprof.report.build_report(SAMPLE).verdict.headline


def test_the_same_run_sends_the_same_ids_again():
    first, second = run_spans(SAMPLE), run_spans(SAMPLE)
    ids = [(span.context.trace_id, span.context.span_id) for span in first]
    assert ids == [(span.context.trace_id, span.context.span_id) for span in second] and len(set(ids)) == len(ids)


def test_an_endpoint_that_takes_nothing_is_one_line_and_exit_2():
    endpoint = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    done = gpuprof_cli("export", str(SAMPLE), "--to", "otlp", "--endpoint", endpoint)
    run = gpuprof.load_run(SAMPLE)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"gpuprof export: error: the OTLP endpoint {endpoint} did not take the {len(run.steps) + len(run.ranks)} "
        "spans (is a collector listening there?)"]
