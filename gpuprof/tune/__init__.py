"""`gpuprof tune`: each fix the diagnoses recommend, applied from outside the script in a measured trial
(docs/tune.md). `tuning.tune` runs the trials, `trials` runs and measures one, `edits` writes the diff."""
