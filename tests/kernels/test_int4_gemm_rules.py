"""The rules of the INT4 ops, written once in kernels/ops/ (validation.py, configs.py): validation order and messages,
split-K legality and partition, config spaces, the prune rule, and the op family's contract.
No GPU needed: fake CUDA tensors stand in for real ones."""

import types

import pytest
import torch
import triton
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from coalesced_int4.kernels import (
    INT4_QUANTIZED_GEMM,
    SPLIT_K_CANDIDATES,
    SUPPORTED_BUCKETS,
    TILE_SPLIT_K_CANDIDATES,
    W4A8_BUCKETS,
    InvalidLaunchParam,
    check_split_k,
    int4_autotune_configs,
    prune_int4_configs,
)
from coalesced_int4.kernels.gemm.split_k import split_programs
from coalesced_int4.kernels.ops.configs import (
    W4A8_PREFETCH,
    W4A8_STAGES,
    W4A8_TILES,
    W4A16_REGISTER_CAPS,
    W4A16_STAGES,
    W4A16_TILES,
    W4A16_TMA_STAGES,
    balanced_short_columns,
    default_split_k,
    w4a16_batch_rows,
)
from coalesced_int4.kernels.ops.family import QuantizedGemmFamily
from tests.helpers import packed_weight, run_compiling_python


def _args(m=1, k=512, n=64):
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = dict(device="cuda")
        return [
            torch.empty(m, k, dtype=torch.bfloat16, **cuda),
            torch.empty(n, k // 2, dtype=torch.uint8, **cuda),
            torch.empty(n, k // 32, dtype=torch.uint8, **cuda),
            torch.empty(n, k // 256, dtype=torch.float16, **cuda),
            torch.empty(n, k // 32, dtype=torch.uint8, **cuda),
            torch.empty(n, k // 256, dtype=torch.float16, **cuda),
            32,
        ]


def _expect_unsupported(bucket, args, pattern):
    assert not INT4_QUANTIZED_GEMM.supports(bucket, *args)
    with pytest.raises(RuntimeError, match=f"int4_quantized_gemm_m{bucket}: {pattern}"):
        INT4_QUANTIZED_GEMM.validate(bucket, *args)


def test_every_bucket_accepts_m_equal_to_its_size():
    for bucket in SUPPORTED_BUCKETS:
        args = _args(m=bucket)
        assert INT4_QUANTIZED_GEMM.supports(bucket, *args)
        INT4_QUANTIZED_GEMM.validate(bucket, *args)


def _resized(t, *shape):
    return torch.empty(shape, dtype=t.dtype, device="cuda")


def _set(index, make):
    def mutate(args):
        with FakeTensorMode(allow_non_fake_inputs=True):
            args[index] = make(args[index])
    return mutate


RULES = {
    "rank": (_set(0, lambda x: x.unsqueeze(0)), "expects a rank-2 activation and qdata"),
    "activation dtype": (_set(0, lambda x: x.half()), "activation must be bfloat16, got float16"),
    "qdata dtype": (_set(1, lambda t: t.float()), "qdata must be uint8/int8, got float32"),
    "scale dtype": (_set(2, lambda t: t.int()), "scale codes must be uint8, got int32"),
    "zero dtype": (_set(4, lambda t: t.to(torch.int8)), "zero codes must be uint8, got int8"),
    "step dtype": (_set(3, lambda t: t.float()), "scale_step must be float16, got float32"),
    "zero step dtype": (_set(5, lambda t: t.bfloat16()), "zero_point_step must be float16, got bfloat16"),
    "group size": (lambda a: a.__setitem__(6, 64), "group_size must be 32, got 64"),
    "static M": (_set(0, lambda x: torch.cat([x, x])), r"static M must be within \[1, 1\], got 2"),
    "contiguous": (_set(1, lambda t: torch.empty_strided(t.shape, (1, t.shape[0]), dtype=t.dtype, device="cuda")),
                   "inputs must be contiguous"),
    "word boundary": (_set(4, lambda t: torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
                                .as_strided(t.shape, t.stride(), 1)),
                      "zero codes must start on a 4-byte boundary .*, got storage offset 1"),
    "cpu activation": (lambda a: a.__setitem__(slice(0, 6), [torch.empty(t.shape, dtype=t.dtype) for t in a[:6]]),
                       r"activation must be on a CUDA device \(or fake while tracing\)"),
    "device": (lambda a: a.__setitem__(2, torch.empty(a[2].shape, dtype=a[2].dtype)),
               "activation and weights must be on the same device"),
    "qdata K": (_set(1, lambda t: _resized(t, 64, 128)),
                r"qdata must hold K=512 in 256 bytes a row \(K padded to 512\), got 128"),
    "scale shape": (_set(2, lambda t: _resized(t, 64, 15)), r"scale/zero shape does not match \[N, 512/32\]"),
    "zero shape": (_set(4, lambda t: _resized(t, 63, 16)), r"scale/zero shape does not match \[N, 512/32\]"),
    "step shape": (_set(3, lambda t: _resized(t, 63, 2)), r"step shape does not match \[N, 512/256\]"),
}


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_is_reported_and_never_raised_by_supports(rule):
    mutate, pattern = RULES[rule]
    args = _args()
    mutate(args)
    _expect_unsupported(1, args, pattern)


def test_w4a16_buckets_refuse_an_activation_off_a_16_byte_boundary():
    args = _args(m=4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        args[0] = torch.empty(4 * 512 + 4, dtype=torch.bfloat16, device="cuda").as_strided((4, 512), (512, 1), 4)
    _expect_unsupported(8, args, "activation must start on a 16-byte boundary .*, got storage offset 4")
    assert INT4_QUANTIZED_GEMM.supports(4, *args)  # the W4A8 kernels read it by pointers
    with FakeTensorMode(allow_non_fake_inputs=True):
        args[0] = torch.empty(4 * 512 + 8, dtype=torch.bfloat16, device="cuda").as_strided((4, 512), (512, 1), 8)
    assert INT4_QUANTIZED_GEMM.supports(8, *args)


def test_k_must_be_a_multiple_of_32_and_the_weights_stored_padded_to_whole_super_blocks():
    args = _args(k=512)
    with FakeTensorMode(allow_non_fake_inputs=True):
        args[0] = torch.empty(1, 300, dtype=torch.bfloat16, device="cuda")
    _expect_unsupported(1, args, "K must be a multiple of 32, got 300")
    with FakeTensorMode(allow_non_fake_inputs=True):
        args[0] = torch.empty(1, 224, dtype=torch.bfloat16, device="cuda")
    _expect_unsupported(1, args, r"qdata must hold K=224 in 128 bytes a row \(K padded to 256\), got 256")
    with FakeTensorMode(allow_non_fake_inputs=True):
        args[0] = torch.empty(1, 480, dtype=torch.bfloat16, device="cuda")
    assert INT4_QUANTIZED_GEMM.supports(1, *args)  # K = 480 is stored in 512 columns


def test_rules_are_checked_in_order():
    args = _args(m=3)
    args[6] = 64  # group size (rule 3) comes before static M (rule 6)
    _expect_unsupported(1, args, "group_size must be 32")


def test_unknown_buckets_are_refused_by_op_and_validate():
    with pytest.raises(RuntimeError, match=r"unsupported int4_quantized_gemm bucket 5; expected one of \(1, 2, 3, 4, 8, 16, 32, 64\)"):
        INT4_QUANTIZED_GEMM.op(5)
    with pytest.raises(RuntimeError, match="unsupported int4_quantized_gemm bucket 5"):
        INT4_QUANTIZED_GEMM.validate(5, *_args())
    assert not INT4_QUANTIZED_GEMM.supports(5, *_args())


def test_ops_are_registered_per_bucket():
    assert SUPPORTED_BUCKETS == (1, 2, 3, 4, 8, 16, 32, 64)
    for bucket in SUPPORTED_BUCKETS:
        op = getattr(torch.ops.coalesced_int4, f"int4_quantized_gemm_m{bucket}")
        assert INT4_QUANTIZED_GEMM.op(bucket) is op is INT4_QUANTIZED_GEMM.op(bucket)
        assert "Tensor x, Tensor qdata" in str(op.default._schema)


def test_the_op_validates_before_launching():
    x, *weights = _args(m=2)
    with pytest.raises(RuntimeError, match="static M must be within"):
        INT4_QUANTIZED_GEMM.op(1)(torch.empty(2, 512, dtype=torch.bfloat16), *[torch.empty(t.shape, dtype=t.dtype) for t in weights[:5]], 32)


def test_fake_kernel_keeps_m_and_gives_bf16():
    args = _args(m=3, n=40)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = INT4_QUANTIZED_GEMM.op(4)(*args)
    assert out.shape == (3, 40) and out.dtype == torch.bfloat16 and out.device.type == "cuda"


def _toy(x: "torch.Tensor", weight: "torch.Tensor", scale: float) -> "torch.Tensor":
    raise NotImplementedError


def test_a_family_sorts_buckets_resolves_postponed_annotations_and_validates_first():
    launched = []
    family = QuantizedGemmFamily(
        "toy_family_gemm", (4, 1, 2), _toy,
        launch=lambda b, x, w, s: launched.append(b) or x.new_empty(x.shape[0], w.shape[0]),
        fake=lambda b, x, w, s: x.new_empty(x.shape[0], w.shape[0]),
        unsupported_reason=lambda b, x, w, s: None if x.shape[0] <= b else f"{x.shape[0]} rows exceed the bucket",
        kernels=lambda b: (),
    )
    assert family.buckets == (1, 2, 4)
    assert "Tensor x, Tensor weight, float scale" in str(family.op(1).default._schema)
    with pytest.raises(RuntimeError, match="toy_family_gemm_m1: 2 rows exceed the bucket"):
        family.op(1)(torch.zeros(2, 3), torch.zeros(4, 3), 1.0)
    assert launched == [] and not family.supports(1, torch.zeros(2, 3), torch.zeros(4, 3), 1.0)
    assert family.op(2)(torch.zeros(2, 3), torch.zeros(4, 3), 1.0).shape == (2, 4) and launched == [2]
    for bad in ((), (0, 1), (1, 1)):
        with pytest.raises(ValueError, match="buckets must be distinct positive row counts"):
            QuantizedGemmFamily("bad", bad, _toy, None, None, None, None)


@pytest.mark.parametrize("k", [256, 768, 4096, 6656])
def test_split_k_needs_one_super_block_per_split(k):
    for split in sorted(set(SPLIT_K_CANDIDATES + TILE_SPLIT_K_CANDIDATES)):
        if split <= k // 256:
            check_split_k(split, k)
        else:
            with pytest.raises(InvalidLaunchParam, match=f"split_k={split} needs K >= {split * 256}, got K={k}"):
                check_split_k(split, k)


def test_w4a8_config_space():
    for bucket in (1, 2, 3, 4):
        configs = int4_autotune_configs(bucket)
        seen = {(c.kwargs["BLOCK_N"], c.kwargs["GROUPS"], c.num_warps, c.kwargs["STAGES"], c.num_stages,
                 c.kwargs["PREFETCH"]) for c in configs}
        assert seen == {(n, g, w, s, s, p) for n, g, w in W4A8_TILES for s in W4A8_STAGES for p in W4A8_PREFETCH}
        assert len(configs) == len(W4A8_TILES) * len(W4A8_STAGES) * len(W4A8_PREFETCH)


def test_w4a16_multiplies_48_rows_only_for_a_static_m_of_at_most_48_at_bucket_64():
    assert [w4a16_batch_rows(64, m) for m in (33, 40, 48, 49, 64)] == [48, 48, 48, 64, 64]
    symbolic_m = ShapeEnv().create_unbacked_symint()
    assert w4a16_batch_rows(64, symbolic_m) == 64  # one binary serves a dynamic M's range
    for bucket in (8, 16, 32):
        assert {w4a16_batch_rows(bucket, m) for m in range(bucket // 2 + 1, bucket + 1)} == {bucket}


def test_a_launch_for_a_symbolic_m_is_timed_on_the_kernel_the_graph_compiles(monkeypatch):
    """A symbolic M of bucket 64 is timed on concrete stand-ins (M = its hint, 40 here); every
    timed launch multiplies the whole bucket's 64 rows, as the traced graph's kernel does, not
    the 48 rows of an eager M = 40."""
    from coalesced_int4.kernels.autotune import launch_params
    from coalesced_int4.kernels.gemm import w4a16
    from coalesced_int4.kernels.ops import int4_gemm

    rows = []
    monkeypatch.setattr(w4a16, "launch_split_k_gemm", lambda kernel, **kw: rows.append(kw["constants"]["BATCH_ROWS"])
                        or types.SimpleNamespace(cost=1.0))
    monkeypatch.setattr(w4a16, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(launch_params, "time_calls_us", lambda calls: [call() for call in calls][0].cost)
    x = torch.randn(40, 1024, dtype=torch.bfloat16)  # real CPU tensors: nothing runs on them
    weights, _ = packed_weight(512, 1024)
    for dynamic_m, expected in ((True, 64), (False, 48)):
        rows.clear()
        launch_params.clear_launch_param_cache()
        with launch_params.autotune_launch_params() as stats:
            int4_gemm._launch_w4a16(64, x, *weights, dynamic_m)
        assert stats.measured == 1 and rows and set(rows) == {expected}, dynamic_m
    launch_params.clear_launch_param_cache()


@pytest.mark.parametrize("n, k, family, sms, split", [
    (4096, 4096, "w4a8", 132, 1),     # 256 tiles of 16 rows fill 132 SMs
    (1024, 4096, "w4a8", 132, 4),     # 64 tiles: split until 132 programs
    (1024, 1024, "w4a8", 132, 1),     # no split shorter than 1024 of K
    (1024, 2048, "w4a8", 132, 2),     # the longest split that keeps 1024 of K
    (4096, 4096, "w4a16", 132, 4),    # 64 tiles of 64 rows, about two an SM
    (14336, 4096, "w4a16", 132, 2),
    (128256, 4096, "w4a16", 132, 1),
    (4096, 4096, "w4a16", None, 1),   # no CUDA device to count SMs of
])
def test_an_untuned_launch_splits_k_until_its_programs_fill_the_sms_once_or_twice(n, k, family, sms, split):
    candidates = SPLIT_K_CANDIDATES if family == "w4a8" else TILE_SPLIT_K_CANDIDATES
    assert default_split_k(n, k, family, candidates, sms) == split


def test_w4a16_config_space_copies_activations_by_tma_only_at_its_stages_and_caps_registers_once():
    for bucket in (8, 16, 32, 64):
        configs = int4_autotune_configs(bucket)
        seen = [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.kwargs["STAGES"], c.num_stages,
                 c.kwargs["TMA_ACTIVATIONS"], c.maxnreg) for c in configs]
        uncapped = [(n, k, w, s, s, s in W4A16_TMA_STAGES, None) for n, k, w in W4A16_TILES for s in W4A16_STAGES]
        capped = [(*tile, tile[-1], tile[-1] in W4A16_TMA_STAGES, cap) for tile, cap in W4A16_REGISTER_CAPS.items()]
        assert sorted(seen, key=str) == sorted(uncapped + capped, key=str)
        # Three-stage TMA gave wrong tiles on the H200 (W4A16_TMA_STAGES): never in the space.
        assert not any(c.kwargs["TMA_ACTIVATIONS"] for c in configs if c.kwargs["STAGES"] >= 3)
    with pytest.raises(ValueError, match="no autotune space for bucket 5"):
        int4_autotune_configs(5)


@pytest.mark.parametrize(
    "bucket, k, split, max_stages",
    [(4, 256, 1, 1), (4, 8192, 1, 2), (4, 8192, 16, 1), (8, 256, 1, 2), (8, 512, 1, 3), (8, 1024, 4, 2),
     (8, 6656, 1, 3), (64, 6656, 8, 3), (64, 6656, 26, 2)],
)
def test_prune_drops_stages_beyond_the_main_loop_trips(bucket, k, split, max_stages):
    configs = int4_autotune_configs(bucket)
    kept = prune_int4_configs(configs, {"K": k}, split_k=split)
    assert max(c.kwargs["STAGES"] for c in kept) == max_stages
    # Kept iff its stages fit its own trips: W4A8 splits super-blocks (8 groups of 32 each)
    # and walks GROUPS a trip; W4A16 splits its trips of BLOCK_K.
    def trips(c):
        if "GROUPS" in c.kwargs:
            return max(1, -(-(-(-(k // 256) // split) * 8) // c.kwargs["GROUPS"]))
        return -(-(k // c.kwargs["BLOCK_K"]) // split)

    assert kept == [c for c in configs if c.kwargs["STAGES"] <= trips(c)]


@pytest.mark.parametrize("n, split_k, sms", [
    (6656, 4, 132), (6656, 3, 132), (6656, 2, 132), (4096, 3, 132), (14336, 2, 132), (39936, 2, 132),
    (257, 4, 6), (6656, 4, 78),
])
def test_balanced_grid_gives_every_sm_the_same_count_of_programs(n, split_k, sms):
    """Placed in order one to an SM at a time, the balanced grid's programs of 64 rows fill every
    SM to the same count (one SM one short where the excess is odd), the short tiles' longer
    programs at most one to an SM, and the short columns are whole tiles of every BLOCK_N."""
    short_columns = balanced_short_columns(n, split_k, sms)
    programs = split_programs(n, split_k, short_columns, 64)
    per_sm = -(-programs // sms)
    assert programs in (per_sm * sms, per_sm * sms - 1), (programs, per_sm)
    assert per_sm == triton.cdiv(n, 64) * split_k // sms
    assert short_columns % 128 == 0 and 0 < short_columns <= n
    assert short_columns // 64 * (split_k - 1) <= sms


def test_balanced_grid_on_the_h200_splits_20_tiles_of_6656_columns_three_ways_at_split_4():
    """416 programs for 132 SMs: 20 tiles give up a program, and every SM holds three."""
    assert balanced_short_columns(6656, 4, 132) == 20 * 64


@pytest.mark.parametrize("n, split_k, sms, reason", [
    (6656, 4, None, "needs the SM count of a CUDA device"),
    (6656, 1, 132, "split_k=1 has no balanced grid"),
    (8448, 4, 132, "already as many on every SM"),
    (4096, 2, 132, "fewer than one an SM"),
    (4096, 4, 132, "more than N's whole tiles can give up"),
    (6656, 8, 132, "some SMs would hold two"),
])
def test_balanced_grid_is_refused_where_none_exists(n, split_k, sms, reason):
    with pytest.raises(InvalidLaunchParam, match=reason):
        balanced_short_columns(n, split_k, sms)


def test_prune_keeps_the_shallowest_config_when_none_fits():
    configs = [triton.Config({"STAGES": 3}), triton.Config({"STAGES": 2})]
    assert prune_int4_configs(configs, {"K": 256}) == [configs[1]]


def test_compiled_graph_caches_key_on_every_kernel_an_op_launches():
    # AOTAutograd's cache keys a graph on the source of the kernels torch records for each
    # triton_op in it (and of every Triton function they call); an op recorded without its
    # kernels would serve a graph compiled before a kernel changed.
    from torch._library.triton import get_triton_kernels_for_op

    for bucket in SUPPORTED_BUCKETS:
        kernels = get_triton_kernels_for_op(INT4_QUANTIZED_GEMM.op(bucket).default._name)
        gemm = "_w4a8_kernel" if bucket in W4A8_BUCKETS else "_w4a16_kernel"
        expected = {gemm, "_splitk_reduce_kernel"} | ({"_quantize_kernel"} if bucket in W4A8_BUCKETS else set())
        assert {kernel.__name__ for kernel in kernels} == expected, bucket
    # The source the key is made of, read where kernels are not interpreted: every recorded
    # kernel's can be read, and a helper's change (here the W4A16 kernel's activation_rows)
    # changes it too.
    closure = run_compiling_python(
        "from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code as source\n"
        "from torch._library.triton import get_triton_kernels_for_op\n"
        "from coalesced_int4.kernels import INT4_QUANTIZED_GEMM, SUPPORTED_BUCKETS\n"
        "sources = {b: [source(k) for k in get_triton_kernels_for_op(INT4_QUANTIZED_GEMM.op(b).default._name)]\n"
        "           for b in SUPPORTED_BUCKETS}\n"
        "print(sources[64][0])")
    assert closure.returncode == 0, closure.stderr[-2000:]
    assert "def activation_rows(" in closure.stdout and "def _w4a16_kernel(" in closure.stdout
