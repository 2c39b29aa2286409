"""Exports of a recorded run to the trackers people already watch (TensorBoard), from the run and its report."""
