"""``benchmarks/wgmma_rate.py`` times the tensor-core instruction of the W4A16 main loop alone.
Its numbers mean that only if its loop is that instruction and the operand's rebuild: checked
offline on the sm_90 SASS (Triton's bundled ptxas, no GPU needed)."""

import pytest

from tests.helpers import sm90_main_loop

POINTERS = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32"}


@pytest.mark.parametrize("n", [16, 64, 256])
@pytest.mark.parametrize("register_a", [True, False])
def test_the_timed_loop_is_the_w4a16_dot_and_nothing_else(n, register_a):
    loop = sm90_main_loop("wgmma_rate", "wgmma_loop", POINTERS, {"N": n, "REGISTER_A": register_a, "OUTSTANDING": 1})
    dots = [text for text in loop if "GMMA" in text]
    # Whole 128-deep dots (the loop may be unrolled), each HGMMA.64xNx16 with the left operand
    # where the variant puts it: a register, or a shared-memory descriptor.
    assert dots and len(dots) % 8 == 0
    assert all(text.startswith(f"HGMMA.64x{n}x16.F32.BF16") for text in dots)
    assert all(operand.startswith("R") == register_a for operand in
               (text.split(",")[1].strip() for text in dots))
    # No layout conversion through shared memory and no global traffic inside the loop.
    assert not [text for text in loop if text.split()[0].split(".")[0] in ("STS", "LDS", "LDSM", "LDG", "STG")]
    if register_a:
        assert sum(text.startswith("HMUL2.BF16") for text in loop) == 32 * len(dots) // 8  # the rebuild
