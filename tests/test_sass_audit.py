"""scripts/sass_audit.py: the kernels' sm_90 machine code, read without a GPU, and the faults it
found kept fixed.

The parsers run everywhere; the end-to-end checks need nvcc and cuobjdump (they compile the
kernels to a cubin, about a minute on 2 cores) and are skipped without them.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import load_script


def test_loads_in_flight_end_at_the_first_read_of_their_register():
    m = load_script("sass_audit")
    serial = ["LDG.E.U8 R3, desc[UR4][R10.64]", "IMAD R4, R3, R3, RZ",  # each load used at once
              "LDG.E.U8 R5, desc[UR4][R10.64+0x20]", "IMAD R6, R5, R5, RZ"]
    assert m.loads_in_flight(serial) == 1
    together = ["@!P0 LDG.E.U16.CONSTANT R18, desc[UR10][R2.64]", "LDG.E.128 R8, desc[UR4][R16.64]",
                "LDG.E.64 R12, desc[UR4][R16.64+0x10]", "FADD R0, R11, R11",  # the 128-bit load's last word
                "IMAD R1, R18, R13, RZ"]
    assert m.loads_in_flight(together) == 3
    stored = ["LDG.E R3, desc[UR4][R10.64]", "STG.E desc[UR4][R12.64], R3", "LDG.E R4, desc[UR4][R10.64]"]
    assert m.loads_in_flight(stored) == 1  # (a store reads its value operand)


def test_ptxas_report_and_occupancy():
    m = load_script("sass_audit")
    report = """ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'
ptxas info    : Function properties for _Z1kv
    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 24576 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_Z1jv' for 'sm_90'
ptxas info    : Used 43 registers, used 0 barriers, 400 bytes cmem[0]"""
    assert m.ptxas_resources(report) == {"_Z1kv": (80, 8, 24576), "_Z1jv": (43, 0, 0)}
    assert m.blocks_per_sm(80, 24576) == 3   # registers: 80 x 256 threads, three in 64K
    assert m.blocks_per_sm(87, 24576) == 2   # (the LayerNorm backward before its register cap)
    assert m.blocks_per_sm(43, 0) == 5       # 43 rounds up to 48 a thread (256-register warp units)
    assert m.blocks_per_sm(32, 100 * 1024) == 2  # shared memory decides


needs_tools = pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(),
                                 reason="needs nvcc (a CUDA toolkit; no GPU)")

KERNELS = (r"^(layer_norm_backward_kernel<(float|c10::BFloat16), 12>"
           r"|dequantize_kernel<(float|c10::BFloat16), unsigned int, 16, "
           r"(StoreAffineCols<c10::BFloat16>|StoreValues<c10::BFloat16>|StoreGeluGrad<c10::BFloat16>"
           r"|StoreGelu<c10::BFloat16>|StoreGeluValueAndGrad<c10::BFloat16>) >"
           r"|(quantize|quantize_observe)_kernel<c10::BFloat16, unsigned int, 16, (true|false)>"
           r"|dequantize_bits_kernel<c10::BFloat16, unsigned int, [248], true>"
           r"|row_cells_kernel<(float|c10::BFloat16)>"
           r"|row_cells_flat_kernel<(float|c10::BFloat16|c10::Half), [124], unsigned (int|long)>"
           r"|observe_kernel<(float|c10::BFloat16|c10::Half), unsigned int, 16, [012]>)$")


@pytest.fixture(scope="module")
def kernels():
    m = load_script("sass_audit")
    try:
        m.cuobjdump()
    except SystemExit:
        pytest.skip("needs cuobjdump (CUDA toolkit or Triton's wheel)")
    return {row["kernel"]: row for row in m.audit(KERNELS)}


@needs_tools
@pytest.mark.parametrize("dtype", ["float", "c10::BFloat16"])
def test_layer_norm_backward_keeps_a_row_of_loads_in_flight(kernels, dtype):
    """A DeiT-S row (12 columns a lane): its 12 code and 12 gradient loads issued before any is
    used, at three 256-thread blocks an SM. Before: 2 in flight (each column waited for its own
    loads), 74 us on the H100 where its bytes take about 20."""
    row = kernels[f"layer_norm_backward_kernel<{dtype}, 12>"]
    assert row["in_flight"] >= 24, row["in_flight"]
    assert row["blocks_per_sm"] >= 3 and row["spill"] == 0, (row["registers"], row["spill"])


@needs_tools
def test_column_epilogue_fetches_its_tables_as_float4s(kernels):
    """The LayerNorm + Linear rebuild: a 16-element step's scale and shift as 4 + 4 128-bit
    loads (plus the codes' one). Before: 32 scalar loads a step, the load pipe saturated."""
    ins = kernels["dequantize_kernel<float, unsigned int, 16, StoreAffineCols<c10::BFloat16> >"]["instructions"]
    m = load_script("sass_audit")
    assert sum(m.opcode(i).startswith("LDG") and ".128" in m.opcode(i) for i in ins) >= 9


@needs_tools
def test_column_epilogue_reads_its_staged_tables_from_shared_memory(kernels):
    """The rebuild with its tables staged (session 38): the block copies them into shared memory
    behind one barrier and a step reads its 4 + 4 float4s there as LDS.128 (a generic LD.E.128,
    which nvcc emitted while the tables were reached through a pointer, is not a shared load),
    at 5 blocks an SM or more without spilling. From L1 they touched 16 cache lines a warp each."""
    row = kernels["dequantize_kernel<float, unsigned int, 16, StoreAffineCols<c10::BFloat16> >"]
    ops = _opcodes(row)
    assert sum(o.startswith("LDS.128") for o in ops) >= 8, sorted({o for o in ops if o.startswith("LD")})
    assert not any(o.startswith("LD.E") for o in ops)
    assert sum(o.startswith("BAR") for o in ops) == 1
    assert row["blocks_per_sm"] >= 5 and row["spill"] == 0, (row["registers"], row["spill"])


@needs_tools
@pytest.mark.parametrize("dtype", ["float", "c10::BFloat16"])
def test_row_cells_reads_its_segment_bounds_from_shared_memory(kernels, dtype):
    """The warp-a-row pass (unequal segments, unaligned x): the segments' bounds come from a
    per-block table (LDS) and a pass's first elements load together; the bounds had been two
    64-bit division calls per lane and pass."""
    row = kernels[f"row_cells_kernel<{dtype}>"]
    m = load_script("sass_audit")
    assert sum(m.opcode(i).startswith("LDS") for i in row["instructions"]) >= 2
    assert row["in_flight"] >= 4


@needs_tools
@pytest.mark.parametrize("dtype", ["float", "c10::BFloat16", "c10::Half"])
@pytest.mark.parametrize("cpl", ["1", "2", "4"])
@pytest.mark.parametrize("index", ["unsigned int", "unsigned long"])
def test_flat_row_pass_keeps_a_round_in_flight_at_five_blocks(kernels, dtype, cpl, index):
    """The layers' row pass (observe_rows on whole-chunk segments): each lane's round of 4
    16-byte loads issued before any is used, 5 blocks an SM, and in its loop (from the first
    16-byte load to the last) no barrier, no spill, nor with 32-bit indices a division call (the
    warp-a-row pass it replaced held 63 registers, 4 blocks an SM, and a barrier a block: 25 us
    on the H200 for 19 MB of bf16 rows). Around the loop, one barrier each side: the block's
    largest max |x| folded in shared memory (a warp's REDUX, one ATOMS) and published with one
    global atomic, so that the finish need not walk the rows for it. The pass ends at the
    ticket's fence (MEMBAR): what follows is the last block's mean, k and cell scaling
    (row_cells_finish, not inlined). No spill anywhere in the pass, at either index width."""
    row = kernels[f"row_cells_flat_kernel<{dtype}, {cpl}, {index}>"]
    ops = _opcodes(row)
    assert row["in_flight"] >= 4, row["in_flight"]
    assert row["blocks_per_sm"] >= 5, row["registers"]
    assert row["spill"] == 0, row["spill"]
    fence = next(n for n, o in enumerate(ops) if o.startswith("MEMBAR"))
    rows_pass, finish = ops[:fence], ops[fence:]
    wide = [n for n, o in enumerate(rows_pass) if o.startswith("LDG") and ".128" in o]
    assert len(wide) >= 4
    loop = rows_pass[wide[0]:wide[-1] + 1]
    assert not any(o.startswith(("BAR", "LDS", "STS", "LDL", "STL")) for o in loop), sorted(set(loop))
    assert sum(o.startswith("BAR") for o in rows_pass) == 2, sorted(set(rows_pass))
    assert any(o.startswith("ATOMS.MAX") for o in rows_pass) and any(o.startswith("REDUX.MAX") for o in rows_pass)
    if index == "unsigned int":  # (64-bit: a segment's row by the division routine, tensors of 2^30+ elements)
        assert not any(o.startswith("CALL") for o in rows_pass)
    assert any(o.startswith("ATOMG.E.ADD") for o in finish) and any(o.startswith("CALL") for o in finish)


@needs_tools
@pytest.mark.parametrize("dtype", ["float", "c10::BFloat16", "c10::Half"])
@pytest.mark.parametrize("mode", ["0", "1", "2"])  # observe, group_minmax, delayed_observe
def test_observe_keeps_four_wide_loads_in_flight_at_four_blocks(kernels, dtype, mode):
    """observe's stage 1 (reduce_chunk): a thread issues 64 bytes of 16-byte loads before it uses
    any (two steps of a 16-bit type, one of float32) at 4 blocks an SM without spilling, and takes
    its min / max with one FMNMX.NAN each (PTX min.NaN / max.NaN) where nan_min's select chain
    was five instructions an element. Before: one bf16 step (2 loads) at a time, 4 blocks: 0.28
    of clone's bandwidth on the H200 for the token layout."""
    m = load_script("sass_audit")
    row = kernels[f"observe_kernel<{dtype}, unsigned int, 16, {mode}>"]
    ops = _opcodes(row)
    # the 16-byte loads alone (the row exponents' byte loads would count too)
    wide = [i for i in row["instructions"] if not m.opcode(i).startswith("LDG") or ".128" in m.opcode(i)]
    assert m.loads_in_flight(wide) >= 4, m.loads_in_flight(wide)
    assert row["blocks_per_sm"] >= 4 and row["spill"] == 0, (row["registers"], row["spill"])
    assert sum(o.startswith("FMNMX.NAN") for o in ops) >= 30  # a 16-element step: 15 min and 15 max


@needs_tools
@pytest.mark.parametrize("epilogue", ["StoreGeluValueAndGrad", "StoreGeluGrad", "StoreGelu"])
def test_gelu_epilogues_read_a_step_from_the_table_of_codes(kernels, epilogue):
    """The GELU epilogues (gelu_value_and_grad, gelu_backward, dequantize_gelu): a step's 16
    entries as 16 shared loads from the block's table of the codes' values (LDS.64, or LDS of the
    one half an epilogue reads), filled behind one barrier,
    at 4 blocks an SM or more without spilling (gelu_value_and_grad took 99.5 us a call on the
    H200 for DeiT-S's (128, 197, 1536) hidden, an erff and an expf an element: 1.19 ms a step)."""
    row = kernels[f"dequantize_kernel<c10::BFloat16, unsigned int, 16, {epilogue}<c10::BFloat16> >"]
    ops = _opcodes(row)
    assert sum(o.startswith("LDS") for o in ops) >= 16, sum(o.startswith("LDS") for o in ops)
    assert sum(o.startswith("BAR") for o in ops) == 1
    assert row["blocks_per_sm"] >= 4 and row["spill"] == 0, (row["registers"], row["spill"])


def _opcodes(row) -> list[str]:
    m = load_script("sass_audit")
    return [m.opcode(i) for i in row["instructions"]]


@needs_tools
@pytest.mark.parametrize("kernel", ["quantize_kernel", "quantize_observe_kernel"])
@pytest.mark.parametrize("stochastic", ["true", "false"])
def test_codes_come_from_one_saturating_conversion(kernels, kernel, stochastic):
    """quantize_code: each code one F2IP (cvt to u8 clamps and takes NaN to 0) where a clamp of
    two FMNMX and an F2I on the conversion unit were (and, rounding to nearest, the 2^23 add and
    subtract): the ALU pipe bound the stochastic quantize (0.58 of clone's bandwidth on the H100)."""
    ops = _opcodes(kernels[f"{kernel}<c10::BFloat16, unsigned int, 16, {stochastic}>"])
    assert sum(o.startswith("F2IP.U8") for o in ops) >= 16  # the 16-element step's codes
    # (quantize_observe's min / max are FMNMX.NAN, not a clamp)
    assert not any(o.startswith("FMNMX") and ".NAN" not in o for o in ops)
    # (a few F2I remain outside the codes: quantize_observe's launch arithmetic; there were 33)
    assert sum(o.startswith("F2I.") for o in ops) <= 4, sorted({o for o in ops if o.startswith("F2I")})


@needs_tools
@pytest.mark.parametrize("kernel", ["dequantize_kernel<c10::BFloat16, unsigned int, 16, StoreValues<c10::BFloat16> >",
                                    "dequantize_kernel<c10::BFloat16, unsigned int, 16, StoreGeluGrad<c10::BFloat16> >",
                                    "dequantize_kernel<float, unsigned int, 16, StoreAffineCols<c10::BFloat16> >",
                                    "layer_norm_backward_kernel<c10::BFloat16, 12>",
                                    "dequantize_bits_kernel<c10::BFloat16, unsigned int, 2, true>",
                                    "dequantize_bits_kernel<c10::BFloat16, unsigned int, 4, true>",
                                    "dequantize_bits_kernel<c10::BFloat16, unsigned int, 8, true>"])
def test_codes_become_floats_without_the_conversion_unit(kernels, kernel):
    """byte_value / code_value: a code's float as 2^23's bits with the byte below them, minus 2^23
    (PRMT or LOP3, FADD), where nvcc had extracted each byte and converted half of them with
    I2F.U16, an instruction of the conversion unit (16 an SM a clock)."""
    ops = _opcodes(kernels[kernel])
    # (I2F.U32.RP: an integer division's reciprocal, once a launch or a row, not a code's)
    assert not any(o.startswith("I2F.U16") for o in ops)
    assert sum(o.startswith("I2F") for o in ops) <= 4, sorted({o for o in ops if o.startswith("I2F")})


def test_conversions_count_the_conversion_unit_only():
    m = load_script("sass_audit")
    code = ["F2I.TRUNC.NTZ R6, R27", "F2IP.U8.F32.TRUNC.NTZ R7, RZ, R2, RZ", "I2F.U16 R7, R7",
            "I2FP.F32.U32 R9, R9", "F2F.BF16.F32 R14, R14", "F2FP.BF16.F32.PACK_AB R8, R15, R8",
            "FMNMX R9, RZ, R19, !PT"]
    assert m.conversions(code) == 3


@needs_tools
@pytest.mark.parametrize("kernel", ["quantize_kernel", "quantize_observe_kernel"])
def test_the_uniform_is_added_in_one_fused_multiply_add(kernels, kernel):
    """quantize_code: v + u as one FFMA of the hash's 16-bit units by 2^-16 (an exact product:
    one rounding, as v + u), where an FMUL by the scale and an FADD were."""
    m = load_script("sass_audit")
    ins = kernels[f"{kernel}<c10::BFloat16, unsigned int, 16, true>"]["instructions"]
    scaled = [i for i in ins if "1.52587890625e-05" in i]  # 2^-16
    assert sum(m.opcode(i).startswith("FFMA") for i in scaled) >= 16, scaled[:4]
    assert not any(m.opcode(i).startswith("FMUL") for i in scaled), scaled[:4]


@needs_tools
def test_the_stochastic_quantize_hashes_once_a_pair(kernels):
    """step_units: a 16-element step's uniforms from 8 lowbias32 (one a pair of elements, its low
    and high 16 bits), each half made a float by a PRMT and an FADD (half_units), no conversion.
    Counted by lowbias32's first multiplier: the step's 8, the tail element's 1, the launch
    key's 2 (11; there were 35: one hash an element in each of the step's two branches). The
    hash was most of the stochastic quantize's time over round-to-nearest's on the H200."""
    ins = kernels["quantize_kernel<c10::BFloat16, unsigned int, 16, true>"]["instructions"]
    assert sum("0x7feb352d" in i for i in ins) <= 11, sum("0x7feb352d" in i for i in ins)
    # quantize_observe (the delayed estimator's pass): 8 a step in each of its two branches (41 before)
    ins = kernels["quantize_observe_kernel<c10::BFloat16, unsigned int, 16, true>"]["instructions"]
    assert sum("0x7feb352d" in i for i in ins) <= 25, sum("0x7feb352d" in i for i in ins)
    ops = _opcodes(kernels["quantize_kernel<c10::BFloat16, unsigned int, 16, true>"])
    assert not any(o.startswith(("I2F", "I2FP")) for o in ops), sorted({o for o in ops if o.startswith("I2F")})
