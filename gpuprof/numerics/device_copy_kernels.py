"""The Triton kernels of device_copy.py, in a module of their own: Triton resolves the functions a
kernel calls among its module's globals, and this module imports Triton, which only CUDA machines need."""

import triton
import triton.language as tl


@triton.jit
def any_nonfinite(values, n):
    """Whether values[:n] holds a NaN or an infinity (n is a handful: a loop, no reduction)."""
    count = n * 0  # an int32 scalar, as the loop adds to it
    for i in range(n):
        x = tl.load(values + i).to(tl.float32)
        count += ((x - x) != 0.0).to(tl.int32)  # inf - inf and NaN - NaN are NaN; finite - itself is 0
    return count > 0


@triton.jit(do_not_specialize=["n", "step", "end"])  # n == 1 would be a constant: one kernel for any count
def copy_if_nonfinite(values, n, taken_in, taken_out, step_taken, at_end, step, end, src_table, dst_table,
                      nbytes_table, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    """Every program reads the values and `taken_in`, and all exit at once unless a copy is due. The
    first program writes the flag to `taken_out`, a second buffer: no program reads what another writes."""
    held = tl.load(taken_in) != 0
    go = any_nonfinite(values, n) & (held == 0)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(taken_out, (held | go).to(tl.int32))
        if go:
            tl.store(step_taken, step)
            tl.store(at_end, end)
    if go:
        tensor = tl.program_id(0)
        size = tl.load(nbytes_table + tensor)
        src = tl.load(src_table + tensor).to(tl.pointer_type(tl.uint8))
        dst = tl.load(dst_table + tensor).to(tl.pointer_type(tl.uint8))
        for start in range(tl.program_id(1).to(tl.int64) * BLOCK, size, PROGRAMS * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            inside = offsets < size
            tl.store(dst + offsets, tl.load(src + offsets, mask=inside), mask=inside)
