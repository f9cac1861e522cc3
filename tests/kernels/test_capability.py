"""Each family's least compute capability (``validation.MIN_CAPABILITY``): below it the
validation rule refuses the bucket (dispatch then takes the other family or the fallback), and
at or above it every shipped kernel config compiles offline for sm_80 and sm_90, and one of each
family's for sm_86 and sm_89 (Triton compiles for a target without a GPU; a child process,
since this one interprets)."""

import json
import textwrap

import pytest

from coalesced_int4.kernels import INT4_QUANTIZED_GEMM, SUPPORTED_BUCKETS, W4A8_BUCKETS
from coalesced_int4.kernels.ops import validation
from tests.helpers import BENCHMARKS, PERF_TOOLS, ROOT, run_compiling_python
from tests.kernels.test_int4_gemm_rules import _args, _expect_unsupported

CAPABILITIES = ((8, 0), (8, 6), (8, 9), (9, 0))


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_buckets_below_their_least_capability_are_refused_and_the_rest_accepted(monkeypatch, capability):
    monkeypatch.setattr(validation, "compute_capability", lambda device: capability)
    for bucket in SUPPORTED_BUCKETS:
        args = _args(m=bucket)
        if capability >= validation.MIN_CAPABILITY[bucket]:
            assert INT4_QUANTIZED_GEMM.supports(bucket, *args), bucket
        else:
            assert bucket not in W4A8_BUCKETS
            _expect_unsupported(bucket, args, rf"the W4A16 kernels need compute capability 9\.0 or newer, the "
                                              rf"device has {capability[0]}\.{capability[1]}")


OFFLINE_COMPILES = textwrap.dedent("""
    import json, sys
    from sass_census import CODE_WORDS, POINTERS, compile_offline
    from coalesced_int4.kernels import int4_autotune_configs
    from coalesced_int4.kernels.gemm.split_k import _splitk_reduce_kernel
    from coalesced_int4.kernels.gemm.w4a8 import _quantize_kernel, _w4a8_kernel
    from coalesced_int4.kernels.gemm.w4a16 import _w4a16_kernel
    from coalesced_int4.kernels.ops.validation import MIN_CAPABILITY

    def gemm(bucket, config, partial):
        # The split-K variant also masks a K padded to whole super-blocks: both variants of
        # each constexpr compile, at no extra compile.
        meta = {**config.kwargs, "PARTIAL": partial, "BUCKET": bucket, "MASK_K": partial, "INTERPRET": False,
                "DEPENDENT_LAUNCH": False}
        if bucket <= 4:
            return _w4a8_kernel, {**POINTERS, **({"out_ptr": "*fp32"} if partial else {})}, meta
        meta.update(BATCH_ROWS=bucket, BALANCED=False)
        return _w4a16_kernel, {**POINTERS, **CODE_WORDS, **({"out_ptr": "*fp32"} if partial else {})}, meta

    results = []
    for capability in (80, 86, 89, 90):
        for bucket in (4, 8, 64):
            least = 10 * MIN_CAPABILITY[bucket][0] + MIN_CAPABILITY[bucket][1]
            configs = int4_autotune_configs(bucket)
            # Every config at sm_80 and sm_90; sm_86 and sm_89 take sm_80's PTX features, so one config.
            for index, config in enumerate(configs if capability in (80, 90) else configs[:1]):
                for partial in (False, True):
                    name = f"bucket {bucket} config {index} partial {partial} sm_{capability}"
                    if capability < least:
                        results.append([name, "refused"])
                        continue
                    kernel, pointers, meta = gemm(bucket, config, partial)
                    compile_offline(kernel, pointers, meta, config.num_warps, config.num_stages, config.maxnreg, capability)
                    results.append([name, "compiled"])
        helpers = {
            "quantize": (_quantize_kernel, {"x_ptr": "*bf16", "out_ptr": "*i32"},
                         dict(GROUPS=16, INTERPRET=False, DEPENDENT_LAUNCH=False)),
            "reduce": (_splitk_reduce_kernel, {"partial_ptr": "*fp32", "out_ptr": "*bf16"},
                       dict(SPLIT_K=4, BLOCK_N=128, INTERPRET=False, DEPENDENT_LAUNCH=False)),
        }
        for name, (kernel, pointers, meta) in helpers.items():
            compile_offline(kernel, pointers, meta, 4, 1, None, capability)
            results.append([f"{name} sm_{capability}", "compiled"])
    try:  # the rule is needed: below sm_90 the W4A16 decode does not compile
        kernel, pointers, meta = gemm(16, int4_autotune_configs(16)[0], False)
        compile_offline(kernel, pointers, meta, 4, meta["STAGES"], None, 80)
        results.append(["w4a16 at sm_80", "compiled"])
    except Exception as error:
        results.append(["w4a16 at sm_80", "failed: " + str(error).splitlines()[0][:200]])
    print(json.dumps(results))
""")


def test_every_shipped_config_compiles_for_each_capability_its_rule_admits():
    child = run_compiling_python(OFFLINE_COMPILES, path=(ROOT, BENCHMARKS, PERF_TOOLS))
    assert child.returncode == 0, child.stderr[-3000:]
    results = dict(json.loads(child.stdout.strip().splitlines()[-1]))
    w4a8 = [name for name in results if name.startswith("bucket 4 ")]
    w4a16 = [name for name in results if name.startswith(("bucket 8 ", "bucket 64 "))]
    assert all(results[name] == "compiled" for name in w4a8) and len(w4a8) == 12 * 2 * 2 + 1 * 2 * 2
    assert all(results[name] == ("compiled" if name.endswith("sm_90") else "refused") for name in w4a16)
    assert results["quantize sm_80"] == results["reduce sm_80"] == "compiled"
    assert results["w4a16 at sm_80"].startswith("failed"), results["w4a16 at sm_80"]
