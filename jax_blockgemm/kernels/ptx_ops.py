"""Inline-PTX memory instructions the CuTeDSL kernels need one at a time: shared- and global-memory accesses (the
sm_90a proj_rope epilogue, kernels/sm90/y_tile.py; kernels/quantize_pair.py; the decode and swap_ab kernels' loads
of scale bytes and activations), bulk copies (sm_90 and later; kernels/dequantize.py) and per-thread asynchronous
copies (sm_80 and later; kernels/quantize_pair.py).

Each is one instruction of exactly the width named, and every global store is predicated inside the asm (no branch,
no reconvergence point, so the scheduler may move shuffles and conversions across it). Loads and stores carry a
memory clobber: they stay in program order with each other and with barriers; the `ld_global_nc_*` loads, of memory
no thread writes during the launch, carry none, so the compiler may start them early.
"""

from __future__ import annotations

import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def s32(c: int) -> int:
    """A 32-bit constant as the signed value an Int32 holds."""
    return c - (1 << 32) if c >= 1 << 31 else c


def asm(ret, args, text: str, constraints: str, side_effects: bool, loc, ip):
    """One inline-PTX statement on DSL values `args` (LLVM constraint string; `side_effects` keeps it in place)."""
    return llvm.inline_asm(ret, [a.ir_value(loc=loc, ip=ip) for a in args], text, constraints,
                           has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                           loc=loc, ip=ip)


def words(out, n: int, loc, ip) -> list:
    """The `n` 32-bit results of an inline-PTX statement that returns a struct of i32."""
    return [cutlass.Int32(llvm.extractvalue(T.i32(), out, [i], loc=loc, ip=ip)) for i in range(n)]


@dsl_user_op
def st_shared_v4(addr, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    args = [cutlass.Int32(x) for x in (addr, w0, w1, w2, w3)]
    asm(None, args, "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def st_shared_v2(addr, w0, w1, *, loc=None, ip=None) -> None:
    args = [cutlass.Int32(x) for x in (addr, w0, w1)]
    asm(None, args, "st.shared.v2.b32 [$0], {$1, $2};", "r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def st_shared_u32(addr, w, *, loc=None, ip=None) -> None:
    args = [cutlass.Int32(x) for x in (addr, w)]
    asm(None, args, "st.shared.b32 [$0], $1;", "r,r,~{memory}", True, loc, ip)


@dsl_user_op
def ld_shared_v4(addr, *, loc=None, ip=None) -> list:
    ret = llvm.StructType.get_literal([T.i32()] * 4)
    out = asm(ret, [cutlass.Int32(addr)], "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
              True, loc, ip)
    return words(out, 4, loc, ip)


@dsl_user_op
def ld_shared_u32(addr, *, loc=None, ip=None) -> cutlass.Int32:
    return cutlass.Int32(asm(T.i32(), [cutlass.Int32(addr)], "ld.shared.b32 $0, [$1];", "=r,r,~{memory}", True,
                             loc, ip))


@dsl_user_op
def ld_global_nc_u8(addr, *, loc=None, ip=None) -> cutlass.Int32:
    """One byte of global memory the kernel only reads (the non-coherent path), zero-extended."""
    return cutlass.Int32(asm(T.i32(), [cutlass.Int64(addr)], "ld.global.nc.u8 $0, [$1];", "=r,l", False, loc, ip))


@dsl_user_op
def ld_global_nc_u8_if(addr, pred, *, loc=None, ip=None) -> cutlass.Int32:
    """`ld_global_nc_u8`, or 0 where `pred` is 0 (no access)."""
    return cutlass.Int32(asm(T.i32(), [cutlass.Int64(addr), cutlass.Int32(pred)],
                             "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.nc.u8 $0, [$1]; }",
                             "=r,l,r", False, loc, ip))


@dsl_user_op
def ld_global_nc_v4_if(addr, pred, *, loc=None, ip=None) -> list:
    """16 bytes (four words) of read-only global memory, cached (data every CTA reads), or zeros where `pred` is 0."""
    ret = llvm.StructType.get_literal([T.i32()] * 4)
    out = asm(ret, [cutlass.Int64(addr), cutlass.Int32(pred)],
              "{ .reg .pred p; setp.ne.b32 p, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; "
              "@p ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4]; }", "=r,=r,=r,=r,l,r", False, loc, ip)
    return words(out, 4, loc, ip)


@dsl_user_op
def st_global_u16_if(addr, w, pred, *, loc=None, ip=None) -> None:
    args = [cutlass.Int64(addr), cutlass.Int32(w), cutlass.Int32(pred)]
    asm(None, args, "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.global.b16 [$0], $1; }", "l,r,r,~{memory}", True,
        loc, ip)


@dsl_user_op
def st_global_v4_if(addr, w0, w1, w2, w3, pred, *, loc=None, ip=None) -> None:
    """16 bytes (four words) to a 16-byte aligned global address when pred != 0."""
    args = [cutlass.Int64(addr)] + [cutlass.Int32(x) for x in (w0, w1, w2, w3, pred)]
    asm(None, args, "{ .reg .pred p; setp.ne.b32 p, $5, 0; @p st.global.v4.b32 [$0], {$1, $2, $3, $4}; }",
        "l,r,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def st_global_v2_if(addr, w0, w1, pred, *, loc=None, ip=None) -> None:
    """8 bytes (two words) to an 8-byte aligned global address when pred != 0."""
    args = [cutlass.Int64(addr)] + [cutlass.Int32(x) for x in (w0, w1, pred)]
    asm(None, args, "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.v2.b32 [$0], {$1, $2}; }",
        "l,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def st_global_u8_if(addr, byte, pred, *, loc=None, ip=None) -> None:
    """The low byte of `byte` to a global address when pred != 0."""
    args = [cutlass.Int64(addr), cutlass.Int32(byte), cutlass.Int32(pred)]
    asm(None, args, "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.global.b8 [$0], $1; }", "l,r,r,~{memory}", True,
        loc, ip)


@dsl_user_op
def bulk_load(smem: cutlass.Int32, gmem: cutlass.Int64, size: cutlass.Int32, mbar: cutlass.Int32, *, loc=None,
              ip=None) -> None:
    """cp.async.bulk of `size` bytes (a multiple of 16; both addresses 16-byte aligned) from global to shared memory,
    completing on the mbarrier at shared address `mbar`."""
    args = [cutlass.Int32(smem), cutlass.Int64(gmem), cutlass.Int32(size), cutlass.Int32(mbar)]
    asm(None, args, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def bulk_store(gmem: cutlass.Int64, smem: cutlass.Int32, size: cutlass.Int32, *, loc=None, ip=None) -> None:
    """cp.async.bulk of `size` bytes from shared to global memory, in the thread's current bulk group."""
    args = [cutlass.Int64(gmem), cutlass.Int32(smem), cutlass.Int32(size)]
    asm(None, args, "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;", "l,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def cp_async_16(smem: cutlass.Int32, gmem: cutlass.Int64, src_bytes: cutlass.Int32, *, loc=None, ip=None) -> None:
    """cp.async of 16 bytes from global to shared memory, L1 bypassed and 256 bytes prefetched into L2; only the
    first `src_bytes` (0 or 16) are read, the rest are zero-filled. Completes with the thread's commit group."""
    args = [cutlass.Int32(smem), cutlass.Int64(gmem), cutlass.Int32(src_bytes)]
    asm(None, args, "cp.async.cg.shared.global.L2::256B [$0], [$1], 16, $2;", "r,l,r,~{memory}", True, loc, ip)


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None) -> None:
    """Close the thread's current group of cp.async copies (an empty group is allowed)."""
    asm(None, [], "cp.async.commit_group;", "~{memory}", True, loc, ip)


@dsl_user_op
def cp_async_wait(pending: int, *, loc=None, ip=None) -> None:
    """Wait until at most `pending` of the thread's newest commit groups are in flight; the copies of the older ones
    are then visible to this thread."""
    asm(None, [], f"cp.async.wait_group {pending};", "~{memory}", True, loc, ip)


@dsl_user_op
def byte_perm(a, b, selector: int, *, loc=None, ip=None) -> cutlass.Int32:
    """prmt.b32: bytes of (b:a) picked by the four nibbles of `selector` (lowest nibble -> byte 0)."""
    return cutlass.Int32(asm(T.i32(), [cutlass.Int32(a), cutlass.Int32(b)], f"prmt.b32 $0, $1, $2, {selector};",
                             "=r,r,r", False, loc, ip))


# The open tally: amax zeroed and published before any CTA's max is folded in, all off the CTAs' critical paths.
# Two words per batch, zero at the launch and left so: word 0 says whether amax is open (zeroed), word 1 counts
# 2 * ctas steps: each CTA arrives once and leaves once. The first arrival zeroes amax and opens it (a release);
# every CTA with a max to fold waits until amax is open (an acquire), leaves, and later folds its max in with one
# reduction (`red_max_bits`) that no one waits for; the last to leave closes the tally (both words zero). No CTA
# waits for another's progress, only for the first arrival's two stores, so any number of CTAs may run at once.


# The two pieces of PTX every CTA's turn shares ($0 = the tally, $1 = amax, $2 = the steps; `count` = word 1, `old` and
# `p` declared by the caller): the arrival, whose first zeroes and opens amax, and the close by the last to leave.
def _tally_arrive(steps: int) -> str:
    """Count `steps` on word 1 (`old`: the count before); the first to count zeroes amax and opens it."""
    return (f"atom.relaxed.gpu.global.add.u32 old, [count], {steps}; setp.eq.u32 p, old, 0; "
            "@p st.relaxed.gpu.global.b32 [$1], 0; @p st.release.gpu.global.b32 [$0], 1; ")


def _tally_close_if_last(steps: int) -> str:
    """After counting `steps` from `old`: the one whose count completes the batch's steps zeroes both words."""
    return (f"add.u32 old, old, {steps}; setp.eq.u32 p, old, $2; "
            "@p st.relaxed.gpu.global.b32 [count], 0; @p st.relaxed.gpu.global.b32 [$0], 0; ")


@dsl_user_op
def tally_open(tally: cutlass.Int64, amax: cutlass.Int64, steps, *, loc=None, ip=None) -> None:
    """Arrive at the open tally (above), zero and open amax if first, wait until amax is open, and leave (closing the
    tally if last). `steps`: 2 * the batch's CTAs. Three trips to L2 plus the wait: a thread that has time (the TMA
    producer once its loads are issued) runs it, and the CTA's max is folded in only after it returned."""
    args = [cutlass.Int64(tally), cutlass.Int64(amax), cutlass.Int32(steps)]
    asm(None, args, "{ .reg .pred p; .reg .b32 old, open; .reg .b64 count; add.s64 count, $0, 4; "
                    + _tally_arrive(1) +
                    "$$L_wait_${:uid}: ld.acquire.gpu.global.b32 open, [$0]; setp.eq.u32 p, open, 0; "
                    "@p bra $$L_wait_${:uid}; "
                    "atom.relaxed.gpu.global.add.u32 old, [count], 1; " + _tally_close_if_last(1) + "}",
        "l,l,r,~{memory}", True, loc, ip)


@dsl_user_op
def tally_pass(tally: cutlass.Int64, amax: cutlass.Int64, steps, *, loc=None, ip=None) -> None:
    """Arrive at the open tally and leave at once, for a CTA with no max to fold (an empty work item): zero and open
    amax if first, close the tally if last. `steps`: 2 * the batch's CTAs."""
    args = [cutlass.Int64(tally), cutlass.Int64(amax), cutlass.Int32(steps)]
    asm(None, args, "{ .reg .pred p; .reg .b32 old; .reg .b64 count; add.s64 count, $0, 4; "
                    + _tally_arrive(2) + _tally_close_if_last(2) + "}",
        "l,l,r,~{memory}", True, loc, ip)


@dsl_user_op
def red_max_bits(address: cutlass.Int64, bits, *, loc=None, ip=None) -> None:
    """Fold `bits` (a float32's bits, sign cleared) into the float32 at `address` by an integer max that returns
    nothing (red: the thread does not wait for it)."""
    asm(None, [cutlass.Int64(address), cutlass.Int32(bits)], "red.relaxed.gpu.global.max.s32 [$0], $1;",
        "l,r,~{memory}", True, loc, ip)


@dsl_user_op
def fold_amax_last_cta(tally: cutlass.Int64, amax: cutlass.Int64, bits, ctas, *, loc=None, ip=None) -> None:
    """One CTA's amax `bits` (a float32's bits, sign cleared) into a self-resetting tally, and from the last of
    `ctas` CTAs to arrive, amax itself. The tally is two words that no other kernel touches and that are zero at the
    launch: the running max, then the CTAs arrived. Each CTA maxes its bits into word 0 and counts itself in word 1
    (acq_rel: its max lands before its count, and the last counter sees every max); the last one swaps word 0 for 0,
    stores it at `amax` and zeroes the count. Three trips to L2 for the last CTA; a compare-and-swap of both words
    at once would take two, but all CTAs finish together and their swaps retry one after another (measured: the
    decode kernel 3x slower)."""
    args = [cutlass.Int64(tally), cutlass.Int64(amax), cutlass.Int32(bits), cutlass.Int32(ctas)]
    asm(None, args, "{ .reg .pred p; .reg .b32 old, top; .reg .b64 count; add.s64 count, $0, 4; "
                    "red.relaxed.gpu.global.max.s32 [$0], $2; "
                    "atom.acq_rel.gpu.global.add.u32 old, [count], 1; add.u32 old, old, 1; setp.eq.u32 p, old, $3; "
                    "@p atom.relaxed.gpu.global.exch.b32 top, [$0], 0; @p st.global.b32 [$1], top; "
                    "@p st.relaxed.gpu.global.b32 [count], 0; }", "l,l,r,r,~{memory}", True, loc, ip)
