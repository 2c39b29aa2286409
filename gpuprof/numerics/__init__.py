"""NaN/Inf forensics: always-on finiteness flags, a forensic re-run of the first bad step, replay bundles.

    monitor.py    the collector gpuprof.profile(...) starts: flags per step, policy, events
    state.py      the state each step starts from, kept (on the device) for the re-run
    watch.py      forensic mode: module stack, autograd-node owners, the aten-op check
    forensics.py  re-run one step on private copies and return a Blame
    blame.py      the event's fields and how they are printed
    detectors.py  GradScaler trouble, loss / grad-norm spikes, per-layer gradient outliers
    bundle.py     replay bundles (weights_only) ; replay.py  `gpuprof replay`'s engine
    evaluation.py the outputs of evaluation forwards between steps: a blow-up no step followed
    construction.py  how `gpuprof run`'s script built its model: the recipe replay rebuilds it from

docs/numerics.md explains how to read a report.
"""
