"""The offline SASS census (``tools/perf/sass_census.py``) compiles each GEMM family's kernel
for sm_90 with Triton's bundled ptxas, no GPU needed, and reads its occupancy and main loop:
the numbers design.md's kernel decisions quote before any device time is spent."""

import json
import sys
import textwrap

import pytest

from coalesced_int4.kernels.gemm.w4a16 import IN_PLACE_PARTIALS_BUCKET, dot_waited_within_trip, partials_stored_in_place
from coalesced_int4.kernels.ops.configs import W4A16_REGISTER_CAPS, W4A16_TMA_STAGES
from tests.helpers import BENCHMARKS, PERF_TOOLS, ROOT, run_compiling_python

sys.path.insert(0, PERF_TOOLS)
from sass_census import after_loop, main_loop, opcode  # noqa: E402  (pure text work: safe under the interpreter)

# Run apart from this process: the suite imports the kernels under Triton's interpreter, which
# cannot be compiled for a GPU target.
CENSUS = textwrap.dedent("""
    import json, sys
    from sass_census import census
    family, constants, warps, maxnreg = json.loads(sys.argv[1])
    result = census(family, constants, warps, maxnreg=maxnreg)
    print(json.dumps({"registers": result.registers, "shared": result.shared,
                      "programs_by": result.programs_by, "programs_per_sm": result.programs_per_sm,
                      "main_loop": result.main_loop, "epilogue": result.epilogue,
                      "instructions": sum(result.opcodes.values())}))
""")


def _census(family, constants, warps, maxnreg=None):
    child = run_compiling_python(CENSUS, json.dumps([family, constants, warps, maxnreg]),
                                 path=(ROOT, BENCHMARKS, PERF_TOOLS))
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family, constants, warps, loop_opcode", [
    ("w4a8", {"PARTIAL": False, "BUCKET": 1, "BLOCK_N": 16, "GROUPS": 32, "STAGES": 2, "PREFETCH": False,
              "INTERPRET": False}, 4, "IDP.4A"),
    ("w4a16", {"PARTIAL": False, "BUCKET": 64, "BATCH_ROWS": 64, "BLOCK_N": 64, "BLOCK_K": 256, "STAGES": 3,
               "TMA_ACTIVATIONS": False, "INTERPRET": False},
     4, "HGMMA"),
])
def test_the_census_finds_the_k_loop_and_the_occupancy_limits(family, constants, warps, loop_opcode):
    result = _census(family, constants, warps)
    assert any(text.startswith(loop_opcode) for text in result["main_loop"])  # the products run in the loop
    assert 0 < len(result["main_loop"]) < result["instructions"]
    assert result["programs_per_sm"] == min(result["programs_by"].values()) >= 1
    if family == "w4a16":
        # Three pipeline stages of 64 activation rows x 256 bf16 take 96 KB: two programs per SM
        # at most.
        assert result["shared"] >= 3 * 64 * 256 * 2
        assert 1 <= result["programs_by"]["shared memory"] <= 2


@pytest.mark.parametrize("bucket", [8, 64])
def test_w4a16_group_scales_reach_the_decode_without_shared_memory(bucket):
    """The scale and zero codes are read as int32 words a trip ahead, straight into the
    registers of the decode's layout: the main loop stores nothing to shared memory (a layout
    conversion would, and wait on a barrier every trip) and loads no single bytes. Each lane
    of a quad converts one group's scale and zero codes and the quad shares them by shuffles:
    4 conversions and 8 shuffles a thread and trip here, where each lane converting every
    group of its rows took 16 conversions, and the lane id is read once, before the loop."""
    result = _census("w4a16", {"PARTIAL": False, "BUCKET": bucket, "BATCH_ROWS": bucket, "BLOCK_N": 64,
                               "BLOCK_K": 128, "STAGES": 2, "TMA_ACTIVATIONS": True, "INTERPRET": False}, 4)
    loop = result["main_loop"]
    assert any(text.startswith("LDG.E ") for text in loop)  # the next trip's code words
    assert not any(text.startswith("STS") for text in loop)
    assert not any(text.startswith(("LDG.E.U8", "LDG.E.S8")) for text in loop)
    # Splitting a group's value into both halves of the decode's bf16x2 operands costs no
    # instruction of its own (built from integer ops, it took a mask and a multiply by 0x10001).
    assert not any("0x10001" in text for text in loop)
    conversions = sum(text.startswith("I2F") for text in loop)
    shuffles = sum(text.startswith("SHFL.IDX") for text in loop)
    # 64 rows over 4 warps of 8 quads: 2 rows a thread, 4 groups a trip of 128.
    assert (conversions, shuffles) == (2 * 2, 2 * 4)
    assert not any(text.startswith("S2R") for text in loop)


@pytest.mark.parametrize("bucket, batch_rows, partial", [
    (16, 16, False), (32, 32, False), (64, 64, False), (64, 64, True), (64, 48, False)])
def test_w4a16_dots_are_left_whole_up_to_the_waited_rows_and_in_split_k_programs(bucket, batch_rows, partial):
    """A dot of up to ``WAITED_DOT_MAX_ROWS`` activation rows, or any dot of a split-K
    program, issues a trip's eight ``HGMMA``s behind one fence and one wait for the whole
    dot; a wider one Triton pipelines across trips in 16-wide pieces of K, each behind its
    own fence. Bucket 64 at 48 rows runs two dots on the same decoded weights (32 and 16
    rows), both left whole."""
    loop = _census("w4a16", {"PARTIAL": partial, "BUCKET": bucket, "BATCH_ROWS": batch_rows, "BLOCK_N": 64,
                             "BLOCK_K": 128, "STAGES": 3, "TMA_ACTIVATIONS": False, "INTERPRET": False},
                    4)["main_loop"]
    fences = sum(text.startswith("WARPGROUP.ARRIVE") for text in loop)
    full_waits = sum(text.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0") for text in loop)
    rows_per_dot = (bucket,) if batch_rows == bucket else (bucket // 2, bucket // 4)
    assert {text.split()[0] for text in loop if text.startswith("HGMMA")} == {
        f"HGMMA.64x{rows}x16.F32.BF16" for rows in rows_per_dot}
    assert sum(text.startswith("HGMMA") for text in loop) == len(rows_per_dot) * 128 // 16
    if dot_waited_within_trip(max(rows_per_dot), partial):
        assert fences == full_waits == len(rows_per_dot)
    else:
        assert (fences, full_waits) == (128 // 16, 0)


IN_PLACE = IN_PLACE_PARTIALS_BUCKET.value


@pytest.mark.parametrize("bucket, batch_rows, stages", [
    (IN_PLACE, IN_PLACE, 3), (IN_PLACE, 3 * IN_PLACE // 4, 3), (IN_PLACE, IN_PLACE, W4A16_TMA_STAGES[0]), (16, 16, 3),
])
def test_w4a16_partials_skip_shared_memory_where_stored_in_place(bucket, batch_rows, stages):
    """At ``IN_PLACE_PARTIALS_BUCKET`` with pointer copies, each thread stores its own
    accumulator elements after the loop (one four-byte store an element, no shared-memory
    staging); elsewhere ``tl.store`` stages them through shared memory into
    wider stores."""
    tma = stages in W4A16_TMA_STAGES
    epilogue = _census("w4a16", {"PARTIAL": True, "BUCKET": bucket, "BATCH_ROWS": batch_rows, "BLOCK_N": 64,
                                 "BLOCK_K": 128, "STAGES": stages, "TMA_ACTIVATIONS": tma, "INTERPRET": False},
                       4)["epilogue"]
    shared = sum(opcode(text) in ("STS", "LDS") for text in epilogue)
    global_stores = [text for text in epilogue if opcode(text) == "STG"]
    if partials_stored_in_place(bucket, tma):
        # 64 weight rows x batch_rows fp32 over 128 threads, an element a store.
        assert (shared, len(global_stores)) == (0, 64 * batch_rows // 128)
        assert all(text.startswith("STG.E ") for text in global_stores)
    else:
        assert shared > 0 and len(global_stores) < 64 * batch_rows // 128


# Each kernel launched with programmatic dependent launch, compiled as ``dependent_launch``
# says: the PTX (in program order, the wait first in the entry block) of each.
DEPENDENT_LAUNCH_PTX = textwrap.dedent("""
    import json, sys
    from sass_census import POINTERS, CODE_WORDS, compile_offline
    from coalesced_int4.kernels.gemm.split_k import _splitk_reduce_kernel
    from coalesced_int4.kernels.gemm.w4a8 import _quantize_kernel, _w4a8_kernel
    from coalesced_int4.kernels.gemm.w4a16 import _w4a16_kernel
    dependent = json.loads(sys.argv[1])
    kernels = {
        "w4a16": (_w4a16_kernel, {**POINTERS, **CODE_WORDS},
                  dict(PARTIAL=False, BUCKET=16, BATCH_ROWS=16, BLOCK_N=64, BLOCK_K=128, STAGES=3,
                       TMA_ACTIVATIONS=False, BALANCED=False, MASK_K=False, INTERPRET=False)),
        "w4a16 (TMA)": (_w4a16_kernel, {**POINTERS, **CODE_WORDS},
                        dict(PARTIAL=False, BUCKET=16, BATCH_ROWS=16, BLOCK_N=64, BLOCK_K=128, STAGES=2,
                             TMA_ACTIVATIONS=True, BALANCED=False, MASK_K=False, INTERPRET=False)),
        "w4a16 (balanced)": (_w4a16_kernel, {**POINTERS, **CODE_WORDS, "out_ptr": "*fp32"},
                             dict(PARTIAL=True, BUCKET=64, BATCH_ROWS=64, BLOCK_N=64, BLOCK_K=128, STAGES=3,
                                  TMA_ACTIVATIONS=False, BALANCED=True, MASK_K=False, INTERPRET=False)),
        "w4a8": (_w4a8_kernel, POINTERS,
                 dict(PARTIAL=False, BUCKET=4, BLOCK_N=16, GROUPS=32, STAGES=2, PREFETCH=False, MASK_K=False,
                      INTERPRET=False)),
        "quantize": (_quantize_kernel, {"x_ptr": "*bf16", "out_ptr": "*i32"}, dict(GROUPS=16, INTERPRET=False)),
        "reduce": (_splitk_reduce_kernel, {"partial_ptr": "*fp32", "out_ptr": "*bf16"},
                   dict(SPLIT_K=4, BLOCK_N=128, INTERPRET=False)),
    }
    ptx = {name: compile_offline(kernel, pointers, {**constants, "DEPENDENT_LAUNCH": dependent}, 4,
                                  constants.get("STAGES", 1)).asm["ptx"]
           for name, (kernel, pointers, constants) in kernels.items()}
    print(json.dumps(ptx))
""")
GLOBAL_ACCESSES = ("ld.global", "st.global", "cp.async", "atom.global", "red.global", "tensormap.cp_fenceproxy.global")
"""PTX that reads or writes global memory: loads, stores, copies (cp.async.bulk.tensor is
TMA), atomics, and the copy of a descriptor made on the device into its global scratch."""


def _dependent_launch_ptx(dependent: bool) -> dict:
    child = run_compiling_python(DEPENDENT_LAUNCH_PTX, json.dumps(dependent),
                                 path=(ROOT, BENCHMARKS, PERF_TOOLS))
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_a_capped_config_is_counted_under_its_cap():
    """The census compiles a config with its register cap, as the launch does: capped, the
    TMA config of ``W4A16_REGISTER_CAPS`` fits its cap (uncapped it takes more), and the
    split-K partials are still stored after the loop."""
    (block_n, block_k, warps, stages), cap = next(iter(W4A16_REGISTER_CAPS.items()))
    constants = {"PARTIAL": True, "BUCKET": 64, "BATCH_ROWS": 64, "BLOCK_N": block_n, "BLOCK_K": block_k,
                 "STAGES": stages, "TMA_ACTIVATIONS": stages in W4A16_TMA_STAGES, "INTERPRET": False}
    capped, uncapped = _census("w4a16", constants, warps, cap), _census("w4a16", constants, warps)
    assert capped["registers"] <= cap < uncapped["registers"]
    assert any(text.startswith("STG") for text in capped["epilogue"])
    assert not any(text.startswith("STG") for text in capped["main_loop"])


LAUNCH_NEXT_AT_THEIR_WAIT = ("reduce",)
"""The kernels that let the next kernel launch right after their wait (``dependent_launch``);
the others do once their loads are done."""


def test_dependent_launches_wait_for_the_previous_kernel_before_any_global_memory_access():
    """A kernel launched with programmatic dependent launch may start before the previous
    kernel on the stream ends: each of the family's kernels waits for it before it reads or
    writes global memory, and lets the next kernel launch: the split-K reduction right after the
    wait, the others only after their loads; compiled without it, neither instruction is there."""
    for name, ptx in _dependent_launch_ptx(True).items():
        wait = ptx.find("griddepcontrol.wait")
        first_access = min(i for i in (ptx.find(op) for op in GLOBAL_ACCESSES) if i >= 0)
        assert 0 <= wait < first_access, name
        next_launch = ptx.find("griddepcontrol.launch_dependents")
        if name in LAUNCH_NEXT_AT_THEIR_WAIT:
            assert wait < next_launch < first_access, name
        else:
            assert next_launch > first_access, name
    for name, ptx in _dependent_launch_ptx(False).items():
        assert "griddepcontrol" not in ptx, name


def test_the_k_loop_is_never_a_jump_back_from_the_epilogue():
    """ptxas may lay out the epilogue's jump back into code the loop shares; that span holds the
    kernel's EXIT and is not a loop, however long (one such span, 395 instructions against the
    K loop's 299, was once read as the loop)."""
    body = [(0x10, "HFMA2 R0, R1, R2, R3 ;"), (0x20, "HGMMA.64x64x16.F32.BF16 R4, gdesc[UR4] ;"),
            (0x30, "BRA 0x10 ;"), (0x40, "STG.E [R6], R7 ;"), (0x50, "EXIT ;"), (0x60, "IMAD R8, R9, R10, R11 ;"),
            (0x70, "BRA 0x20 ;")]
    assert main_loop(body) == ["HFMA2 R0, R1, R2, R3 ;", "HGMMA.64x64x16.F32.BF16 R4, gdesc[UR4] ;", "BRA 0x10 ;"]
    assert after_loop(body) == ["STG.E [R6], R7 ;", "EXIT ;", "IMAD R8, R9, R10, R11 ;", "BRA 0x20 ;"]
