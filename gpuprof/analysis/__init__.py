"""Analysis: figures computed from what a run recorded (`run/`) and from torch.profiler traces (`trace/`)."""
