"""The one place that classifies trace events and kernels by name and category.

Kernel types follow HolisticTraceAnalysis (HTA) so temporal and kernel breakdowns can
be checked against it: communication = NCCL/RCCL kernels, memory = memcpy/memset/DMA,
computation = every other kernel except synchronization markers and memcpy-named
kernels, which HTA counts as neither ("other").
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

# Event kinds, from the Chrome-trace category written by Kineto (CUDA, ROCm, older traces).
KIND_BY_CAT = {
    "kernel": "kernel",
    "Kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "Memcpy": "memcpy",
    "gpu_memset": "memset",
    "Memset": "memset",
    "cuda_runtime": "runtime",
    "cuda_driver": "runtime",
    "Runtime": "runtime",
    "cpu_op": "cpu_op",
    "Operator": "cpu_op",
    "operator": "cpu_op",
    "user_annotation": "user_annotation",
    "gpu_user_annotation": "gpu_user_annotation",
    "python_function": "python_function",
    "cuda_sync": "gpu_sync",
}
KINDS = (
    "kernel",
    "memcpy",
    "memset",
    "runtime",
    "cpu_op",
    "user_annotation",
    "gpu_user_annotation",
    "python_function",
    "gpu_sync",
    "other",
)
# Work that occupies a device stream: what HTA calls GPU kernels.
DEVICE_KINDS = ("kernel", "memcpy", "memset")

KERNEL_TYPES = ("computation", "communication", "memory", "other")
COMMUNICATION_RE = re.compile(r"^(nccl|rccl).*Kernel|^rccl")
MEMORY_RE = re.compile(r"^(Memcpy|Memset|dma)")
NOT_COMPUTATION_RE = re.compile(r".*Memcpy|Memset|.*Sync")

# Matrix multiplications: cuBLAS/cuBLASLt/CUTLASS/rocBLAS(Tensile)/hipBLASLt/CK names,
# plus fused attention kernels, which are matmul work too.
MATMUL_RE = re.compile(
    r"(?<!fb)gemm|GEMM|Gemm|gemv|matmul|Matmul|cutlass|cublas|xmma|\bCijk_|wgmma|"
    r"flash_(fwd|bwd)|fmha|attention|Attention",
)
# Kernels that run on tensor cores (NVIDIA) or matrix cores (AMD MFMA).
TENSOR_CORE_RE = re.compile(
    r"[hsi]\d{3,5}gemm|[hi]mma|HMMA|xmma|wgmma|tensorop|TensorOp|tensor_op|_tc_|"
    r"bf16|BF16|fp16|f16f16|tf32|_MI\d+x\d+x|MFMA|mfma|flash_(fwd|bwd)|fmha",
)

# Runtime calls that block the host until the device catches up.
SYNC_CALL_RE = re.compile(
    r"^(cuda|hip)(StreamSynchronize|DeviceSynchronize|EventSynchronize|Memcpy|Memcpy2D|"
    r"MemcpyDtoH|MemcpyFromSymbol)$"
)
ASYNC_COPY_CALL_RE = re.compile(r"^(cuda|hip)Memcpy(Async|2DAsync|DtoHAsync)$")
DEVICE_TO_HOST_RE = re.compile(r"DtoH|Device -> Pageable|Device -> Pinned|DeviceToHost")
# Copies to or from pageable (unpinned) host memory, e.g. "Memcpy HtoD (Pageable -> Device)".
PAGEABLE_COPY_RE = re.compile(r"Pageable")

# CPU-side markers for the step-time breakdown.
DATALOADER_RE = re.compile(r"^enumerate\(DataLoader\)|DataLoader.*__next__|^data$")
CPU_COLLECTIVE_RE = re.compile(r"^(nccl|gloo|mpi|ucc|c10d)[:_]|^record_param_comms$|^c10d::")
PROFILER_STEP_RE = re.compile(r"^ProfilerStep#(\d+)")
# Collectives by kind, from NCCL/RCCL kernel names (ncclDevKernel_AllGather_RING_LL) and
# torch.distributed host ops (c10d::_allgather_base_, c10d::_reduce_scatter_base_, gloo:all_reduce).
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "other")
_COLLECTIVE_KIND_RES = {
    "all_gather": re.compile(r"all_?gather", re.IGNORECASE),
    "reduce_scatter": re.compile(r"reduce_?scatter", re.IGNORECASE),
    "all_reduce": re.compile(r"all_?reduce", re.IGNORECASE),
}
# gloo runs a collective on its own threads, as a `gloo:<op>` annotation (gloo may run a
# reduce-scatter as an all-reduce: the kind comes from the torch.distributed op that issued it).
GLOO_WORK_RE = re.compile(r"^gloo:")
C10D_OP_RE = re.compile(r"^c10d::")


def collective_kind(name: str) -> str:
    """One of COLLECTIVE_KINDS for a communication kernel or collective op name."""
    return next((kind for kind, pattern in _COLLECTIVE_KIND_RES.items() if pattern.search(name)), "other")


def kernel_type(name: str) -> str:
    """HTA's kernel type of one device event name, lower case."""
    if COMMUNICATION_RE.match(name):
        return "communication"
    if MEMORY_RE.match(name):
        return "memory"
    if NOT_COMPUTATION_RE.match(name):
        return "other"
    return "computation"


def kind_of_cat(cat) -> str:
    return KIND_BY_CAT.get(cat, "other")


def event_kinds(cats: pd.Series) -> pd.Series:
    """The kind (one of KINDS) of each event, from its Chrome-trace category."""
    return map_categories(cats, kind_of_cat, KINDS)


def kernel_types(names: pd.Series, kinds: pd.Series) -> pd.Series:
    """HTA's kernel type of each event: by name for kernels, "memory" for memcpys and
    memsets, none for host events."""
    types = map_categories(names, kernel_type, KERNEL_TYPES)
    types[kinds.isin(("memcpy", "memset")).to_numpy()] = "memory"
    types[~kinds.isin(DEVICE_KINDS).to_numpy()] = None
    return types


def map_categories(values: pd.Series, function, categories) -> pd.Series:
    """Apply `function` (whose results are among `categories`) once per distinct value of a categorical Series."""
    values = values.astype("category")
    code_of = {category: code for code, category in enumerate(categories)}
    # The trailing -1 is what a missing value (code -1) maps to.
    mapped = np.array([code_of[function(str(v))] for v in values.cat.categories] + [-1], dtype=np.int8)
    codes = mapped[values.cat.codes.to_numpy()]
    return pd.Series(pd.Categorical.from_codes(codes, categories=categories), index=values.index)


def matches(values: pd.Series, pattern: re.Pattern) -> np.ndarray:
    """Boolean array: does each value of a (categorical) Series match `pattern`."""
    values = values.astype("category")
    hits = np.array([bool(pattern.search(str(v))) for v in values.cat.categories], dtype=bool)
    codes = values.cat.codes.to_numpy()
    return np.where(codes >= 0, hits[codes] if len(hits) else False, False)
