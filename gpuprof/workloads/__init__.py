"""The reference workloads gpuprof trains itself: the GPT-2 demo and test bed (`gpt2/`)."""
