"""Exports of a recorded run to the trackers people already watch (TensorBoard, OTLP backends), from the run and its report."""
