"""Share of matmul time (GEMMs and fused attention) spent in tensor-core kernels."""

from __future__ import annotations

import numpy as np
import pandas as pd

from gpuprof.analysis.trace.classify import MATMUL_RE, TENSOR_CORE_RE, matches
from gpuprof.analysis.trace.events import device_events
from gpuprof.analysis.trace.loader import Trace

COLUMNS = [
    "rank",
    "matmul_kernels",
    "matmul_time_us",
    "tensor_core_time_us",
    "tensor_core_pct",
    "top_non_tensor_core_kernel",
]


def tensor_core_share(trace: Trace) -> pd.DataFrame:
    rows = []
    for rank, rank_trace in trace.ranks.items():
        kernels = device_events(rank_trace.events)
        kernels = kernels[kernels["kind"].eq("kernel").to_numpy()]
        if kernels.empty:
            continue
        matmul = kernels[matches(kernels["name"], MATMUL_RE)]
        on_tensor_cores = matches(matmul["name"], TENSOR_CORE_RE)
        matmul_time = int(matmul["dur_us"].sum())
        tensor_time = int(matmul["dur_us"][on_tensor_cores].sum())
        others = matmul[~on_tensor_cores].groupby("name", observed=True)["dur_us"].sum()
        rows.append(
            [
                rank,
                len(matmul),
                matmul_time,
                tensor_time,
                round(100 * tensor_time / matmul_time, 2) if matmul_time else np.nan,
                str(others.idxmax()) if len(others) else None,
            ]
        )
    return pd.DataFrame(rows, columns=COLUMNS)
