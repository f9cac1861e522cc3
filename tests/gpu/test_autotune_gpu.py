"""Autotuning on the GPU (skipped without CUDA): parallel precompile of an untuned shape,
tracing hands Inductor only a tuned shape's pick, dynamic M is timed apart from static M, and
a second process restores every pick from the persistent cache instead of timing, and one
bucket never restores another bucket's pick."""

import contextlib
import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from coalesced_int4.kernels import (
    BUCKET_KERNELS,
    INT4_QUANTIZED_GEMM,
    autotune_launch_params,
    clear_launch_param_cache,
    launch,
)
from coalesced_int4.kernels.autotune import tuner
from coalesced_int4.kernels.ops import family
from tests.helpers import assert_close_to_reference, dequant_matmul_reference, packed_weight, requires_cuda

pytestmark = requires_cuda


def _packed(n, k, seed):
    return packed_weight(n, k, seed=seed, device="cuda")[0]


def _x(m, k):
    return torch.randn(m, k, dtype=torch.bfloat16, device="cuda")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COALESCED_INT4_CACHE_DIR", str(tmp_path / "picks"))


@pytest.mark.skipif(not tuner.parallel_compile_available(), reason="no parallel compile here")
def test_an_untuned_shape_compiles_its_configs_in_the_pool_first():
    submitted = []
    real = tuner._async_compile.AsyncCompileMode.submit

    def counting(mode, *args, **kwargs):
        submitted.append(args[0])
        return real(mode, *args, **kwargs)

    packed = _packed(384, 2304, seed=7)
    x = _x(2, 2304)
    with mock.patch.object(tuner._async_compile.AsyncCompileMode, "submit", counting):
        out = launch(2, x, *packed, 32, split_k=1)
        pooled = len(submitted)
        again = launch(2, x, *packed, 32, split_k=1)
    assert pooled > 1 and len(submitted) == pooled  # a tuned key is not compiled again
    assert torch.equal(out, again)
    assert_close_to_reference(out, dequant_matmul_reference(x, packed))


@pytest.mark.skipif(not tuner.parallel_compile_available(), reason="no parallel compile here")
def test_every_split_candidate_compiles_in_the_first_pool():
    clear_launch_param_cache()  # the split of this shape is timed here, not restored
    packed = _packed(320, 2816, seed=11)
    x = _x(2, 2816)
    gemm = BUCKET_KERNELS[2].fn

    def compiled():
        return sum(len(caches[0]) for caches in gemm.device_caches.values())

    at_exit, real_pool = [], tuner.compile_pool

    @contextlib.contextmanager
    def recording_pool():
        with real_pool():
            yield
        at_exit.append(compiled())

    gemm.device_caches.clear()  # other tests' binaries of this bucket load again, in the pool
    with mock.patch.object(tuner, "compile_pool", recording_pool), autotune_launch_params() as stats:
        out = launch(2, x, *packed, 32)
    assert stats.measured == 1 and len(stats.picks[0].times_us) > 1
    assert at_exit[0] > 0 and compiled() == at_exit[0]  # the timed launches compiled nothing
    assert_close_to_reference(out, dequant_matmul_reference(x, packed))


def test_fake_tensors_are_never_precompiled():
    real = (_x(1, 1792), *_packed(384, 1792, seed=19))
    with mock.patch.object(tuner, "compile_pool") as pool:
        with FakeTensorMode() as mode:
            launch(1, *(mode.from_tensor(t) for t in real), 32)
    pool.assert_not_called()


def test_a_failing_precompile_does_not_block_the_launch(caplog):
    packed = _packed(320, 1792, seed=29)
    x = _x(1, 1792)
    with mock.patch.object(tuner, "parallel_compile_available", return_value=True), \
            mock.patch.object(BUCKET_KERNELS[1], "warmup", side_effect=RuntimeError("no precompile")):
        out = launch(1, x, *packed, 32)
    assert "no precompile" in caplog.text
    assert_close_to_reference(out, dequant_matmul_reference(x, packed))


def _recording_wrap():
    traced = []
    wrap = family.wrap_triton

    def recording(kernel):
        traced.append(kernel)
        return wrap(kernel)

    return traced, mock.patch.object(family, "wrap_triton", recording)


def test_a_tuned_shape_traces_only_its_picked_config():
    torch._dynamo.reset()
    packed = _packed(832, 1536, seed=41)
    x = _x(16, 1536)
    op = INT4_QUANTIZED_GEMM.op(16)
    with torch.no_grad():
        eager = op(x, *packed, 32)  # tunes this shape
        compiled, code = torch._inductor.utils.run_and_get_code(
            torch.compile(lambda x: op(x, *packed, 32), fullgraph=True), x)
    source = "\n".join(code)
    assert "def _w4a16_kernel(" in source
    block = source[source.rindex("user_autotune(", 0, source.index("def _w4a16_kernel(")):]
    assert block[: block.index("],")].count("'num_warps'") == 1
    assert_close_to_reference(compiled, eager)


def test_an_untuned_shape_traces_every_config():
    real = (_x(16, 1280), *_packed(704, 1280, seed=43))
    traced, patch = _recording_wrap()
    with patch, FakeTensorMode() as mode:
        launch(16, *(mode.from_tensor(t) for t in real), 32, split_k=1)
    assert traced[0] is BUCKET_KERNELS[16]


def test_traced_picks_are_one_object_per_config():
    packed = _packed(832, 1536, seed=42)
    x = _x(16, 1536)
    launch(16, x, *packed, 32, split_k=1)  # tune
    traced, patch = _recording_wrap()
    with patch, FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in (x, *packed)]
        for _ in range(3):
            launch(16, *fake, 32, split_k=1)
    picks = [k for k in traced if k is not BUCKET_KERNELS[16] and len(getattr(k, "configs", [])) == 1]
    assert len(picks) == 3 and all(k is picks[0] for k in picks)
    assert picks[0].configs[0] in BUCKET_KERNELS[16].cache.values()


def test_dynamic_m_is_timed_apart_from_static_m():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    clear_launch_param_cache()
    packed = _packed(768, 512, seed=34)
    x = _x(4, 512)
    with autotune_launch_params() as stats:
        with FakeTensorMode(shape_env=ShapeEnv()) as mode:
            fake_x = mode.from_tensor(x, source=ConstantSource("x"), symbolic_context=StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
            assert not isinstance(fake_x.shape[0], int)
            weights = (mode.from_tensor(t, static_shapes=True) for t in packed)  # parameters are static
            launch(4, fake_x, *weights, 32)
        dynamic_measured = stats.measured
        launch(4, x, *packed, 32)
    assert dynamic_measured == 1 and stats.measured == 2


WARM_START = textwrap.dedent("""
    import sys, time, torch
    from coalesced_int4.kernels import autotune_launch_params, launch
    from tests.helpers import packed_weight
    packed = packed_weight(4096, 4096, seed=1, device="cuda")[0]
    x = torch.randn(4, 4096, dtype=torch.bfloat16, device="cuda")
    start = time.perf_counter()
    with autotune_launch_params() as stats:
        launch(4, x, *packed, 32)
    torch.cuda.synchronize()
    print(stats.measured, stats.restored, time.perf_counter() - start)
""")


def test_a_second_process_restores_picks_instead_of_timing(tmp_path):
    env = {**os.environ, "COALESCED_INT4_CACHE_DIR": str(tmp_path / "warm")}
    runs = [subprocess.run([sys.executable, "-c", WARM_START], env=env, capture_output=True, text=True,
                           check=True, timeout=600).stdout.split() for _ in range(2)]
    (cold_measured, cold_restored, _), (warm_measured, warm_restored, _) = runs
    assert (cold_measured, cold_restored) == ("1", "0")
    assert (warm_measured, warm_restored) == ("0", "1")


def _new_autotuner_like(bucket):
    """A new autotuner of ``bucket``'s kernel, space and store name: nothing picked in this
    process, so ``pick`` can only restore from the store."""
    model = BUCKET_KERNELS[bucket]
    return tuner.PersistentAutotuner(model.fn, model.fn.arg_names, model.configs, model.keys, reset_to_zero=None,
                                     restore_value=None, name=model.name)


def test_a_bucket_times_its_own_configs_after_another_bucket_stored_its_picks():
    """Buckets 1 and 4 share one JIT function and tuning key: bucket 4 must not find bucket
    1's stored pick (it ran M = 1's configs at M = 4 until the store was named per bucket)."""
    packed = _packed(640, 1280, seed=13)  # a shape no other test tunes
    launch(1, _x(1, 1280), *packed, 32, split_k=1)  # tunes bucket 1 and stores its pick
    (key,) = [k for k in BUCKET_KERNELS[1].cache if k[:3] == (640, 1280, 1)]
    assert _new_autotuner_like(4).pick(key, packed) is None  # nothing stored under bucket 4
    assert _new_autotuner_like(1).pick(key, packed) == BUCKET_KERNELS[1].cache[key]  # its own, restored
