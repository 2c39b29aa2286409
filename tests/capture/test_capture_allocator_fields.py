"""The step record's allocator counters, read from the caching allocator's nested statistics
(torch.cuda.memory_stats_as_nested_dict): the values torch.cuda.memory_stats() gives under its
flattened names ("allocated_bytes.all.current"), without its flattening pass."""

from __future__ import annotations

from gpuprof.capture.memory import allocator_fields


def nested_stats() -> dict:
    """The allocator's layout: per statistic, per pool, current/peak/allocated/freed; counters at the top."""
    def pools(base: int) -> dict:
        return {pool: {"current": base + i, "peak": base + 10 + i, "allocated": base + 20 + i, "freed": base + 30 + i}
                for i, pool in enumerate(("all", "large_pool", "small_pool"))}

    return {"allocated_bytes": pools(1000), "reserved_bytes": pools(5000), "active_bytes": pools(9000),
            "num_alloc_retries": 3, "num_ooms": 1, "num_sync_all_streams": 0}


def flattened(stats: dict, prefix: str = "") -> dict:
    """torch.cuda.memory_stats()'s flattening: keys joined with '.'."""
    flat = {}
    for key, value in stats.items():
        name = f"{prefix}.{key}" if prefix else key
        flat.update(flattened(value, name) if isinstance(value, dict) else {name: value})
    return flat


def test_the_fields_are_memory_stats_values_under_their_flat_names():
    stats = nested_stats()
    flat = flattened(stats)
    assert allocator_fields(stats) == {
        "mem_allocated_bytes": flat["allocated_bytes.all.current"],
        "mem_reserved_bytes": flat["reserved_bytes.all.current"],
        "mem_peak_allocated_bytes": flat["allocated_bytes.all.peak"],
        "mem_alloc_retries": flat["num_alloc_retries"],
        "mem_ooms": flat["num_ooms"],
    }


def test_an_uninitialised_allocator_reads_as_zeros():
    assert set(allocator_fields({}).values()) == {0}  # memory_stats_as_nested_dict() before CUDA starts
