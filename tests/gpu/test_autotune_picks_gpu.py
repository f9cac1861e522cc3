"""The config picks AOTInductor compiles in are the fastest ones even while every CPU core is
busy (GPU; skipped without CUDA). A module with the reference's guard shapes is exported and
packaged inside ``autotune_launch_params()`` with one busy process per core; every tuning
decision whose pick was traced into the package is then re-timed with the CPU idle: worst
regret <= 1.10, mean <= 1.03."""

import multiprocessing
import os
import signal
import statistics
import time

import pytest
import torch

from coalesced_int4.kernels import BUCKET_KERNELS, INT4_QUANTIZED_GEMM, autotune_launch_params, clear_launch_param_cache
from coalesced_int4.kernels.autotune import tuner
from coalesced_int4.kernels.autotune.cuda_graph_timing import time_with_cuda_graph_us
from coalesced_int4.kernels.ops.configs import prune_int4_configs
from tests.helpers import packed_weight, requires_cuda

GUARD_SHAPES = ((8192, 2048), (6144, 2048), (2048, 8192), (32000, 2048))  # >= 6 MiB of INT4 each
GUARD_BUCKETS = (1, 4)
EVENT_TICK_US = 0.5  # a pick one event tick slower than the best is not a worse pick
MAX_REGRET, MAX_MEAN_REGRET = 1.10, 1.03
needs_the_machine_alone = pytest.mark.skipif(
    int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1,
    reason="re-times its picks with the CPU idle, which other test processes would not leave it: "
           "run it alone (benchmarks/gpu_checks.sh picks)")


class Int4Decode(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for i, (n, k) in enumerate(GUARD_SHAPES):
            for j, tensor in enumerate(packed_weight(n, k, seed=500 + i, device="cuda")[0]):
                self.register_buffer(f"w{i}_{j}", tensor)

    def forward(self, x1_2048, x4_2048, x1_8192, x4_8192):
        inputs = {(1, 2048): x1_2048, (4, 2048): x4_2048, (1, 8192): x1_8192, (4, 8192): x4_8192}
        outs = []
        for i, (_, k) in enumerate(GUARD_SHAPES):
            weights = [getattr(self, f"w{i}_{j}") for j in range(5)]
            for bucket in GUARD_BUCKETS:
                outs.append(INT4_QUANTIZED_GEMM.op(bucket)(inputs[(bucket, k)], *weights, 32))
        return tuple(outs)


def _spin(deadline):
    while time.time() < deadline:
        pass


class SaturatedCpu:
    """One busy process per core while active."""

    def __enter__(self):
        context = multiprocessing.get_context("spawn")
        self.workers = [context.Process(target=_spin, args=(time.time() + 3600,), daemon=True)
                        for _ in range(os.cpu_count() or 1)]
        for worker in self.workers:
            worker.start()
        return self

    def __exit__(self, *exc):
        for worker in self.workers:
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)


def regret(pick_us, best_us):
    return max(1.0, pick_us / (best_us + EVENT_TICK_US))


@requires_cuda
@needs_the_machine_alone
def test_compile_time_picks_are_the_fastest_under_cpu_load(tmp_path, monkeypatch):
    monkeypatch.setenv("COALESCED_INT4_CACHE_DIR", str(tmp_path / "picks"))  # nothing restored
    clear_launch_param_cache()
    saved = {b: dict(k.cache) for b, k in BUCKET_KERNELS.items()}
    for kernel in BUCKET_KERNELS.values():
        kernel.cache.clear()
    decisions = {}  # (autotuner id, key) -> (autotuner, args, kwargs) of the launch that tuned it
    traced = set()
    real_run, real_tuned = tuner.PersistentAutotuner.run, tuner.tuned_kernel

    def recording_run(self, *args, **kwargs):
        key = tuner.tuning_key(self, args, kwargs)
        untuned = len(self.configs) > 1 and key not in self.cache
        result = real_run(self, *args, **kwargs)
        if untuned:
            decisions[(id(self), key)] = (self, args, kwargs)
        return result

    def recording_tuned(autotuner, args, kwargs):
        chosen = real_tuned(autotuner, args, kwargs)
        if chosen is not autotuner:
            traced.add((id(autotuner), tuner.tuning_key(autotuner, args, kwargs)))
        return chosen

    monkeypatch.setattr(tuner.PersistentAutotuner, "run", recording_run)
    monkeypatch.setattr("coalesced_int4.kernels.gemm.split_k.tuned_kernel", recording_tuned)
    try:
        module = Int4Decode().eval()
        inputs = tuple(torch.randn(b, k, dtype=torch.bfloat16, device="cuda") for k in (2048, 8192) for b in GUARD_BUCKETS)
        with torch.no_grad():
            program = torch.export.export(module, inputs)
        start = time.perf_counter()
        with torch.compiler.config.patch(force_disable_caches=True), SaturatedCpu(), autotune_launch_params():
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "guard.pt2"))
        print(f"AOTI compile with every core busy: {time.perf_counter() - start:.0f} s", flush=True)
        compiled_in = [decisions[key] for key in traced if key in decisions]
        assert len(compiled_in) == len(GUARD_SHAPES) * len(GUARD_BUCKETS)
        regrets = []
        timing_stream = torch.cuda.Stream()  # graph capture refuses the legacy default stream
        for autotuner, args, kwargs in compiled_in:  # re-timed with the CPU idle
            key = tuner.tuning_key(autotuner, args, kwargs)
            launch = {k: v for k, v in kwargs.items() if k != "warmup"}
            meta = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
            times = {}
            for config in prune_int4_configs(autotuner.configs, dict(zip(autotuner.arg_names, args)), **meta):
                run = lambda c=config: autotuner.fn.run(*args, warmup=False, **launch, **c.all_kwargs())  # noqa: E731
                with torch.cuda.stream(timing_stream):
                    times[config] = min(time_with_cuda_graph_us(run) for _ in range(2))
            if len(times) > 1:
                regrets.append(regret(times[autotuner.cache[key]], min(times.values())))
                print(f"{autotuner.base_fn.__name__} {key}: regret {regrets[-1]:.3f} over {len(times)} "
                      f"configs, {time.perf_counter() - start:.0f} s into the test", flush=True)
        print(f"INT4 picks compiled in: {len(regrets)} decisions, mean regret "
              f"{statistics.mean(regrets):.3f}x, worst {max(regrets):.3f}x")
        assert max(regrets) <= MAX_REGRET and statistics.mean(regrets) <= MAX_MEAN_REGRET
    finally:
        for bucket, cache in saved.items():
            BUCKET_KERNELS[bucket].cache.clear()
            BUCKET_KERNELS[bucket].cache.update(cache)


@pytest.mark.parametrize("pick, best, expected", [(10.0, 10.0, 1.0), (10.5, 10.0, 1.0), (11.5, 10.0, 1.095)])
def test_regret_is_tick_aware(pick, best, expected):
    assert regret(pick, best) == pytest.approx(expected, abs=1e-3)
