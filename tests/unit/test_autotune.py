"""Autotuning logic that needs no GPU: the split-K (launch-parameter) selection on toy
functions with a stand-in timer, and autotune_do_bench's routing between CUDA-graph timing and
triton.testing.do_bench."""

import contextlib
import logging
import types
from unittest import mock

import pytest
import torch
import triton
from torch._subclasses.fake_tensor import FakeTensorMode

from coalesced_int4.kernels.autotune import cuda_graph_timing as graph_timing
from coalesced_int4.kernels.autotune import do_bench as do_bench_module
from coalesced_int4.kernels.autotune import launch_params
from coalesced_int4.kernels.autotune.do_bench import AUTOTUNE_REP_MS, AUTOTUNE_WARMUP_MS, autotune_do_bench
from coalesced_int4.kernels.autotune.launch_params import (
    InvalidLaunchParam,
    autotune_launch_param,
    autotune_launch_params,
    clear_launch_param_cache,
)

COST = {1: 12.0, 2: 6.0, 4: 1.0, 8: 3.0, 16: 24.0}


@pytest.fixture(autouse=True)
def fake_timer(monkeypatch):
    """The timer reports each call's cost: the ``cost`` attribute of what the call returns."""
    clear_launch_param_cache()
    monkeypatch.setattr(launch_params, "time_calls_us", lambda calls: calls[0]().cost)
    yield
    clear_launch_param_cache()



def _toy(costs, calls=None, legal=lambda v, x: True):
    @autotune_launch_param(split_k=tuple(costs))
    def run(x, *, split_k):
        if not legal(split_k, x):
            raise InvalidLaunchParam(f"split_k={split_k} is illegal here")
        if calls is not None:
            calls.append(split_k)
        return types.SimpleNamespace(cost=costs[split_k], split_k=split_k)
    return run


def test_outside_the_context_the_first_candidate_runs_untimed():
    calls = []
    assert _toy(COST, calls)(torch.zeros(4)).split_k == 1 and calls == [1]


def _ruled_toy(calls):
    @autotune_launch_param(split_k=tuple(COST), default=lambda x: {"split_k": 8 if x.numel() > 4 else 99})
    def run(x, *, split_k):
        calls.append(split_k)
        return types.SimpleNamespace(cost=COST[split_k], split_k=split_k)
    return run


def test_outside_tuning_an_untuned_shape_runs_the_rule_and_tuning_later_times_it():
    calls = []
    run = _ruled_toy(calls)
    assert run(torch.zeros(8)).split_k == 8
    assert run(torch.zeros(4)).split_k == 1  # a value outside the space: the first candidate
    assert calls == [8, 1]
    with autotune_launch_params() as stats:
        assert run(torch.zeros(8)).split_k == 4
    assert stats.measured == 1
    assert run(torch.zeros(8)).split_k == 4  # the pick, now also outside tuning


def test_outside_tuning_a_stored_pick_is_restored(tmp_path, monkeypatch):
    monkeypatch.setenv("COALESCED_INT4_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launch_params, "pick_store", lambda device, name: launch_params.PickStore("launch_params",
                                                                                                  "test GPU"))
    calls = []
    with autotune_launch_params():
        assert _ruled_toy(calls)(torch.zeros(8)).split_k == 4
    clear_launch_param_cache()  # as a new process starts
    calls.clear()
    assert _ruled_toy(calls)(torch.zeros(8)).split_k == 4 and calls == [4]


def test_process_wide_tuning_tunes_every_shape_without_a_context(monkeypatch):
    monkeypatch.setattr(launch_params, "_TUNE_FROM_ENVIRONMENT", True)  # COALESCED_INT4_AUTOTUNE=1 at start
    calls = []
    assert _ruled_toy(calls)(torch.zeros(8)).split_k == 4
    assert set(calls) == set(COST)  # every candidate ran while timing


def test_inside_the_context_the_fastest_candidate_wins():
    with autotune_launch_params() as stats:
        assert _toy(COST)(torch.zeros(4)).split_k == 4
    assert stats.measured == 1 and set(stats.picks[0].times_us) == {(v,) for v in COST}
    assert stats.picks[0].choice == {"split_k": 4} and stats.picks[0].params == ("split_k",)


def test_each_shape_is_timed_once():
    run = _toy(COST)
    with autotune_launch_params() as stats:
        run(torch.zeros(4))
        run(torch.zeros(8))
        run(torch.zeros(4))
    assert stats.measured == 2 and stats.cache_hits == 1


def test_every_launch_reports_the_value_it_ran_with_however_it_was_decided():
    run = _toy(COST)
    with autotune_launch_params() as stats:
        run(torch.zeros(4))  # timed
        run(torch.zeros(4))  # cached in this process
        run(torch.zeros(4), split_k=2)  # explicit
    assert stats.choices == [{"split_k": 4}, {"split_k": 4}, {"split_k": 2}] and len(stats.picks) == 1


def test_an_explicit_value_is_used_as_is():
    calls = []
    with autotune_launch_params() as stats:
        assert _toy(COST, calls)(torch.zeros(4), split_k=16).split_k == 16
    assert calls == [16] and stats.measured == 0


def test_illegal_candidates_are_skipped_and_reported():
    run = _toy(COST, legal=lambda v, x: v <= 2)
    with autotune_launch_params() as stats:
        assert run(torch.zeros(4)).split_k == 2
    assert set(stats.picks[0].times_us) == {(1,), (2,)} and set(stats.picks[0].rejected) == {(4,), (8,), (16,)}


def test_no_legal_candidate_is_an_error():
    with autotune_launch_params(), pytest.raises(ValueError, match="no legal split_k"):
        _toy(COST, legal=lambda v, x: False)(torch.zeros(4))


def test_near_ties_go_to_the_smaller_value():
    with autotune_launch_params():
        assert _toy({8: 5.0, 2: 5.05, 4: 5.0})(torch.zeros(4)).split_k == 2


PAIR_COST = {(1, False): 9.0, (1, True): 7.0, (2, False): 5.0, (2, True): 4.0, (4, False): 8.0, (4, True): 4.05}


def _pair_toy():
    @autotune_launch_param(split_k=(1, 2, 4), prequantize=(False, True))
    def run(x, *, split_k, prequantize):
        return types.SimpleNamespace(cost=PAIR_COST[split_k, prequantize], values=(split_k, prequantize))
    return run


def test_every_combination_of_two_launch_parameters_is_timed_and_the_fastest_wins():
    with autotune_launch_params() as stats:
        assert _pair_toy()(torch.zeros(4)).values == (2, True)  # (4, True) ties it and comes later
    pick = stats.picks[0]
    assert pick.params == ("split_k", "prequantize") and set(pick.times_us) == set(PAIR_COST)
    assert pick.choice == {"split_k": 2, "prequantize": True}
    assert stats.choices == [{"split_k": 2, "prequantize": True}]


def test_a_launch_parameter_passed_explicitly_leaves_the_others_timed():
    with autotune_launch_params() as stats:
        assert _pair_toy()(torch.zeros(4), split_k=1).values == (1, True)
        assert _pair_toy()(torch.zeros(4), prequantize=False).values == (2, False)
    assert [pick.params for pick in stats.picks] == [("prequantize",), ("split_k",)]
    assert stats.choices[0] == {"split_k": 1, "prequantize": True}


def test_outside_the_context_every_launch_parameter_takes_its_first_value():
    assert _pair_toy()(torch.zeros(4)).values == (1, False)


def test_running_out_of_memory_twice_falls_back_to_the_first_candidate(caplog):
    attempts = []

    @autotune_launch_param(split_k=(1, 2))
    def run(x, *, split_k):
        if launch_params._state.stats is not None and len(attempts) < 2 and x.device.type == "cpu":
            attempts.append(split_k)
            raise torch.OutOfMemoryError("no memory")
        return types.SimpleNamespace(cost=1.0, split_k=split_k)

    with caplog.at_level(logging.WARNING), autotune_launch_params() as stats:
        assert run(torch.zeros(4)).split_k == 1
    assert stats.out_of_memory == 1 and stats.measured == 0
    assert "out of device memory while timing split_k candidates; using split_k=1" in caplog.text


def test_fake_inputs_are_timed_on_real_stand_ins():
    seen = []

    @autotune_launch_param(split_k=(1, 2))
    def run(x, *, split_k):
        seen.append(type(x).__name__)
        return types.SimpleNamespace(cost=float(3 - split_k), split_k=split_k)

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.zeros(4, 4))
    with autotune_launch_params():
        with mode:
            assert run(fake).split_k == 2
    assert "Tensor" in seen and seen[-1] == "FakeTensor"


def test_declaration_errors():
    with pytest.raises(ValueError, match="needs at least one parameter"):
        autotune_launch_param()
    with pytest.raises(ValueError, match="needs at least one candidate for split_k"):
        autotune_launch_param(split_k=())
    with pytest.raises(TypeError, match="has no parameter 'num_splits'"):
        autotune_launch_param(num_splits=(1, 2))(lambda x, *, split_k: x)


# ---------------------------------------------------------------- autotune_do_bench


def _on_stream(cuda_stream):
    return mock.patch.object(torch.cuda, "current_stream", return_value=types.SimpleNamespace(cuda_stream=cuda_stream))


def test_graph_timing_on_a_side_stream_times_in_a_graph():
    call = mock.Mock()
    with _on_stream(1), mock.patch.object(do_bench_module, "graph_timing_active", return_value=True), \
            mock.patch.object(do_bench_module.graph_timing, "time_with_cuda_graph_us", return_value=1500.0) as graph, \
            mock.patch.object(triton.testing, "do_bench") as bench:
        assert autotune_do_bench(call, None) == 1.5
        assert autotune_do_bench(call, (0.5, 0.2, 0.8)) == [1.5, 1.5, 1.5]
    graph.assert_called_with(call)
    bench.assert_not_called()


def test_outside_graph_timing_triton_times_it():
    call = mock.Mock()
    with _on_stream(1), mock.patch.object(do_bench_module, "graph_timing_active", return_value=False), \
            mock.patch.object(do_bench_module.graph_timing, "time_with_cuda_graph_us") as graph, \
            mock.patch.object(triton.testing, "do_bench", return_value=2.0) as bench:
        assert autotune_do_bench(call, None) == 2.0
    graph.assert_not_called()
    bench.assert_called_once_with(call, warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS, quantiles=None)


def test_the_legacy_default_stream_is_timed_by_triton():
    with _on_stream(0), mock.patch.object(do_bench_module, "graph_timing_active", return_value=True), \
            mock.patch.object(do_bench_module.graph_timing, "time_with_cuda_graph_us") as graph, \
            mock.patch.object(triton.testing, "do_bench", return_value=2.0) as bench:
        autotune_do_bench(mock.Mock(), None)
    graph.assert_not_called()
    bench.assert_called_once()


def test_a_failing_graph_timing_falls_back_and_says_so_once(caplog):
    with _on_stream(1), mock.patch.object(do_bench_module, "graph_timing_active", return_value=True), \
            mock.patch.object(do_bench_module.graph_timing, "time_with_cuda_graph_us", side_effect=RuntimeError("capture failed")), \
            mock.patch.object(do_bench_module, "_graph_timing_fallback_warned", False), \
            mock.patch.object(triton.testing, "do_bench", return_value=[0.3, 0.2, 0.4]), \
            caplog.at_level(logging.WARNING, logger=do_bench_module.logger.name):
        for _ in range(2):
            assert autotune_do_bench(mock.Mock(), (0.5, 0.2, 0.8))[0] > 0
    records = [r for r in caplog.records if r.name == do_bench_module.logger.name]
    assert len(records) == 1 and "capture failed" in records[0].getMessage()


def test_cuda_graph_timing_context_nests():
    assert not do_bench_module.graph_timing_active()
    with do_bench_module.cuda_graph_timing():
        with do_bench_module.cuda_graph_timing():
            assert do_bench_module.graph_timing_active()
        assert do_bench_module.graph_timing_active()
    assert not do_bench_module.graph_timing_active()


@pytest.mark.parametrize("bytes_per_copy", [1, 3 * 2**20, 14_155_776, 50 * 2**20, 2**30])
def test_a_rotation_holds_the_fewest_copies_that_cover_twice_the_l2(bytes_per_copy):
    l2 = 60 * 2**20
    with mock.patch.object(torch.cuda, "get_device_properties", return_value=types.SimpleNamespace(L2_cache_size=l2)):
        copies = graph_timing.copies_beyond_l2(bytes_per_copy, torch.device("cuda", 0))
    # Besides the first call's copy, the others together cover twice the L2, and one fewer would not.
    assert (copies - 1) * bytes_per_copy >= 2 * l2 > (copies - 2) * bytes_per_copy


# ---------------------------------------------------------------- persistent picks

from coalesced_int4.kernels.autotune import persistent  # noqa: E402
from coalesced_int4.kernels.autotune.persistent import PickStore, config_to_json, matching_config  # noqa: E402
from coalesced_int4.kernels.autotune.tuner import tuning_key  # noqa: E402


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(persistent.DIRECTORY_ENV, str(tmp_path))
    monkeypatch.delenv(persistent.SWITCH_ENV, raising=False)
    return tmp_path


def test_a_pick_survives_into_a_new_store(cache_dir):
    PickStore("kernel", "NVIDIA H200").put([4096, 4096, 1, "torch.bfloat16"], {"BLOCK_N": 32})
    again = PickStore("kernel", "NVIDIA H200")
    assert again.get([4096, 4096, 1, "torch.bfloat16"]) == {"BLOCK_N": 32}
    assert again.get([4096, 4096, 2, "torch.bfloat16"]) is None  # a miss


def test_another_gpu_triton_or_kernel_source_misses(cache_dir, monkeypatch):
    PickStore("kernel", "NVIDIA H200").put("k", 1)
    assert PickStore("kernel", "NVIDIA H100 80GB HBM3").get("k") is None
    monkeypatch.setattr(persistent.triton, "__version__", "9.9.9")
    assert PickStore("kernel", "NVIDIA H200").get("k") is None
    monkeypatch.undo()
    monkeypatch.setenv(persistent.DIRECTORY_ENV, str(cache_dir))
    monkeypatch.setattr(persistent, "kernel_source_hash", lambda: "another source")
    assert PickStore("kernel", "NVIDIA H200").get("k") is None


def test_a_corrupt_or_foreign_file_is_ignored_and_rewritten(cache_dir, caplog):
    store = PickStore("kernel", "NVIDIA H200")
    store.path.parent.mkdir(parents=True, exist_ok=True)
    store.path.write_text("{ not json")
    with caplog.at_level(logging.DEBUG, logger=persistent.logger.name):
        assert store.get("k") is None
    assert "ignoring autotune cache" in caplog.text
    store.put("k", 3)
    assert PickStore("kernel", "NVIDIA H200").get("k") == 3
    store.path.write_text('{"identity": {"kind": "someone else"}, "picks": {"\\"k\\"": 5}}')
    assert store.get("k") is None


def test_the_cache_can_be_turned_off(cache_dir, monkeypatch):
    monkeypatch.setenv(persistent.SWITCH_ENV, "0")
    store = PickStore("kernel", "NVIDIA H200")
    store.put("k", 1)
    assert store.get("k") is None and list(cache_dir.iterdir()) == []


def test_a_stored_config_is_trusted_only_inside_the_current_space():
    configs = [triton.Config({"BLOCK_N": n}, num_warps=4, num_stages=1) for n in (16, 32)]
    assert matching_config(configs, config_to_json(configs[1])) is configs[1]
    assert matching_config(configs, {"kwargs": {"BLOCK_N": 128}, "num_warps": 4, "num_stages": 1}) is None


def test_the_tuning_key_is_the_one_triton_caches_under():
    from coalesced_int4.kernels import BUCKET_KERNELS

    autotuner = BUCKET_KERNELS[8]
    names = autotuner.arg_names
    args = [torch.zeros(1, dtype=torch.bfloat16) if n.endswith("_ptr") else i  # each integer its own value
            for i, n in enumerate(names[:names.index("PARTIAL")])]
    kwargs = {"PARTIAL": False, "BUCKET": 8, "BATCH_ROWS": 8, "INTERPRET": False}
    key = tuning_key(autotuner, args, kwargs)
    named = dict(zip(names, args))
    assert key[:5] == (named["N"], named["K"], named["split_k"], named["short_columns"], 8)
    assert key[5:] == tuple(["torch.bfloat16"] * 7)


def test_each_buckets_tuning_key_names_only_its_kernels_arguments():
    """Triton skips a key name its kernel lacks, so a stray name would be silently ignored."""
    from coalesced_int4.kernels import BUCKET_KERNELS

    for bucket, autotuner in BUCKET_KERNELS.items():
        assert set(autotuner.keys) <= set(autotuner.arg_names), (bucket, autotuner.keys)


# ---------------------------------------------------------------- precompile and tracing picks

from coalesced_int4.kernels.autotune import tuner  # noqa: E402


def _gate(version, async_compile=types.SimpleNamespace()):
    tuner.parallel_compile_available.cache_clear()
    try:
        with mock.patch.object(tuner, "_async_compile", async_compile), \
                mock.patch.object(tuner, "sys", types.SimpleNamespace(version_info=version)):
            return tuner.parallel_compile_available()
    finally:
        tuner.parallel_compile_available.cache_clear()


def test_parallel_compile_needs_triton_async_compile_and_a_thread_safe_ast():
    assert not _gate((3, 12, 5, "final", 0), async_compile=None)
    for version in ((3, 11, 4), (3, 11, 7), (3, 12, 1)):
        assert not _gate((*version, "final", 0)), version
    for version in ((3, 11, 8), (3, 12, 2), (3, 13, 0)):
        assert _gate((*version, "final", 0)), version


def _mock_autotuner(cache=None):
    return mock.Mock(spec=triton.runtime.Autotuner, configs=[1, 2], cache=cache or {}, arg_names=["x"], keys=[])


@pytest.mark.parametrize("gate", [False, True])
def test_the_gate_decides_whether_an_untuned_launch_precompiles(gate):
    autotuner = _mock_autotuner()
    with mock.patch.object(tuner, "parallel_compile_available", return_value=gate), \
            mock.patch.object(tuner, "compile_pool", mock.MagicMock()):
        tuner.precompile_untuned_configs(autotuner, (torch.zeros(2),), {})
    assert autotuner.warmup.called == gate


def test_precompile_passes_the_launch_keywords_once():
    autotuner = _mock_autotuner()
    with mock.patch.object(tuner, "parallel_compile_available", return_value=True), \
            mock.patch.object(tuner, "compile_pool", mock.MagicMock()):
        tuner.precompile_untuned_configs(autotuner, (torch.zeros(2),), {"grid": (7,), "warmup": False, "BUCKET": 1})
    autotuner.warmup.assert_called_once()
    assert autotuner.warmup.call_args.kwargs == {"grid": (1,), "BUCKET": 1}


def test_fake_or_tuned_launches_are_not_precompiled():
    with mock.patch.object(tuner, "parallel_compile_available", return_value=True), \
            mock.patch.object(tuner, "compile_pool", mock.MagicMock()):
        autotuner = _mock_autotuner()
        with FakeTensorMode() as mode:
            fake = mode.from_tensor(torch.zeros(2))
        tuner.precompile_untuned_configs(autotuner, (fake,), {})
        assert not autotuner.warmup.called
        tuned = _mock_autotuner(cache={("torch.float32",): 1})
        tuner.precompile_untuned_configs(tuned, (torch.zeros(2),), {})
        assert not tuned.warmup.called


def test_a_failing_precompile_is_logged_and_harmless(caplog):
    autotuner = _mock_autotuner()
    autotuner.warmup.side_effect = RuntimeError("no precompile")
    autotuner.base_fn = types.SimpleNamespace(__name__="toy_kernel")
    with mock.patch.object(tuner, "parallel_compile_available", return_value=True), \
            mock.patch.object(tuner, "compile_pool", mock.MagicMock()), \
            caplog.at_level(logging.WARNING, logger=tuner.logger.name):
        tuner.precompile_untuned_configs(autotuner, (torch.zeros(2),), {})
    assert "no precompile" in caplog.text


def test_a_tuned_key_is_traced_with_one_object_holding_only_its_pick():
    from coalesced_int4.kernels import BUCKET_KERNELS

    autotuner = BUCKET_KERNELS[8]
    names = autotuner.arg_names
    args = tuple(torch.zeros(1, dtype=torch.bfloat16) if n.endswith("_ptr") else 1 << 12
                 for n in names[:names.index("PARTIAL")])
    kwargs = {"PARTIAL": False, "BUCKET": 8, "BATCH_ROWS": 8, "INTERPRET": False}
    assert tuner.tuned_kernel(autotuner, args, kwargs) is autotuner  # untuned: every config
    key = tuning_key(autotuner, args, kwargs)
    autotuner.cache[key] = autotuner.configs[1]
    try:
        picked = tuner.tuned_kernel(autotuner, args, kwargs)
        assert picked is not autotuner and picked.configs == [autotuner.configs[1]]
        assert picked.fn is autotuner.fn and tuner.tuned_kernel(autotuner, args, kwargs) is picked
    finally:
        del autotuner.cache[key]


import triton.language as tl  # noqa: E402


@triton.jit
def _increment_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def test_a_persistent_autotuner_stores_its_pick_and_a_new_one_restores_it(cache_dir, monkeypatch):
    monkeypatch.setattr(tuner, "_store_for", lambda name, args: PickStore(name, "test GPU"))
    timings = iter([2.0, 1.0])  # the second config is faster
    configs = [triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})]

    def make(do_bench):
        return tuner.persistent_autotune(configs, key=["n"], prune_configs_by=None, do_bench=do_bench,
                                         name="increment")(_increment_kernel)

    first = make(lambda call, quantiles: [next(timings)] * len(quantiles))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.zeros(300, device=device)
    first[(triton.cdiv(300, 64),)](x, 300)
    assert first.cache[(300, "torch.float32")] is configs[1]

    second = make(mock.Mock(side_effect=AssertionError("a restored pick is not timed")))
    second[(triton.cdiv(300, 64),)](x, 300)
    assert second.cache[(300, "torch.float32")] == configs[1]
    assert torch.equal(x, torch.full((300,), 2.0, device=device))  # launched once per call


def test_autotuners_of_one_kernel_keep_their_stored_picks_apart(cache_dir, monkeypatch):
    """One autotuner per bucket wraps the same JIT function with the same key: a pick stored
    by one must not be restored by another (their best configs differ)."""
    monkeypatch.setattr(tuner, "_store_for", lambda name, args: PickStore(name, "test GPU"))
    configs = [triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})]

    def make(name, timings):
        timings = iter(timings)
        return tuner.persistent_autotune(configs, key=["n"], prune_configs_by=None, name=name,
                                         do_bench=lambda call, quantiles: [next(timings)] * len(quantiles),
                                         )(_increment_kernel)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.zeros(300, device=device)
    one_row, four_rows = make("gemm_m1", [2.0, 1.0]), make("gemm_m4", [1.0, 2.0])
    one_row[(triton.cdiv(300, 64),)](x, 300)
    four_rows[(triton.cdiv(300, 64),)](x, 300)
    assert one_row.cache[(300, "torch.float32")] is configs[1]
    assert four_rows.cache[(300, "torch.float32")] is configs[0]  # timed, not restored
    assert make("gemm_m4", []).pick((300, "torch.float32"), [x]) == configs[0]  # its own, restored


def test_every_bucket_stores_its_picks_under_its_own_name():
    from coalesced_int4.kernels import BUCKET_KERNELS

    names = [autotuner.name for autotuner in BUCKET_KERNELS.values()]
    assert None not in names and len(set(names)) == len(BUCKET_KERNELS)


# ---------------------------------------------------------------- one pool for every split candidate

def _recording_pool(entered):
    @contextlib.contextmanager
    def pool():
        entered.append("open")
        yield
        entered.append("closed")
    return pool


@pytest.mark.parametrize("gate", [False, True])
def test_the_prepass_pools_and_queues_only_where_the_gate_is_on(gate):
    entered = []
    with mock.patch.object(tuner, "parallel_compile_available", return_value=gate), \
            mock.patch.object(tuner, "compile_pool", _recording_pool(entered)):
        with tuner.compile_every_candidate_at_once() as queued:
            assert queued == gate and tuner.queuing_only() == gate
    assert not tuner.queuing_only()
    assert entered == (["open", "closed"] if gate else [])


def test_every_split_candidate_queues_its_compiles_in_one_pool_before_any_runs():
    entered, calls = [], []

    @autotune_launch_param(split_k=(1, 2, 4))
    def run(x, *, split_k):
        if split_k == 4:
            raise InvalidLaunchParam("split_k=4 is illegal here")
        calls.append((split_k, tuner.queuing_only(), len(entered)))
        return types.SimpleNamespace(cost=float(split_k), split_k=split_k)

    with mock.patch.object(tuner, "parallel_compile_available", return_value=True), \
            mock.patch.object(tuner, "compile_pool", _recording_pool(entered)), \
            autotune_launch_params() as stats:
        assert run(torch.zeros(4)).split_k == 1
    assert entered == ["open", "closed"]  # one pool, opened once
    # queued inside the pool, then each legal candidate runs once, the timed rounds, the launch
    assert calls[:2] == [(1, True, 1), (2, True, 1)]
    assert calls[2:4] == [(1, False, 2), (2, False, 2)]
    assert len(calls) == 4 + launch_params.ROUNDS * 2 + 1 and stats.picks[0].rejected.keys() == {(4,)}


def test_while_queuing_an_autotuner_submits_compiles_and_launches_nothing():
    configs = [triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})]
    autotuner = tuner.persistent_autotune(configs, key=["n"], prune_configs_by=None,
                                          do_bench=mock.Mock(), name="increment")(_increment_kernel)
    autotuner.cache[(512, "torch.float32")] = configs[1]
    with mock.patch.object(tuner, "parallel_compile_available", return_value=True), \
            mock.patch.object(tuner, "compile_pool", _recording_pool([])), \
            mock.patch.object(tuner, "_queue_compiles") as queued, \
            mock.patch.object(triton.runtime.Autotuner, "run") as launched:
        with tuner.compile_every_candidate_at_once():
            assert autotuner[(3,)](torch.zeros(300), 300) is None  # untuned: every config
            autotuner[(3,)](torch.zeros(512), 512)  # tuned: its pick alone
    assert [call.args[0] for call in queued.call_args_list] == [autotuner, tuner.single_config(autotuner, configs[1])]
    assert queued.call_args_list[0].args[2] == {"grid": (3,), "warmup": False} and not launched.called


def test_while_queuing_a_helper_kernel_is_compiled_not_launched():
    kernel = mock.MagicMock()
    with mock.patch.object(tuner, "parallel_compile_available", return_value=True), \
            mock.patch.object(tuner, "compile_pool", _recording_pool([])):
        with tuner.compile_every_candidate_at_once():
            tuner.launch_or_queue(kernel, (2, 1), "a", BLOCK=4)
        tuner.launch_or_queue(kernel, (2, 1), "b", BLOCK=4)
    kernel.warmup.assert_called_once_with("a", grid=(2, 1), BLOCK=4)
    kernel.__getitem__.assert_called_once_with((2, 1))
    kernel.__getitem__.return_value.assert_called_once_with("b", BLOCK=4)


def test_split_k_timing_behind_the_one_pool_prepass_gives_the_reference_result():
    from coalesced_int4.kernels import launch
    from tests.helpers import assert_close_to_reference, dequant_matmul_reference, packed_weight

    device = "cuda" if torch.cuda.is_available() else "cpu"
    packed = packed_weight(64, 1024, seed=3, device=device)[0]
    x = torch.randn(2, 1024, dtype=torch.bfloat16, device=device)
    queued = []
    real_queue = tuner._queue_compiles

    def recording(autotuner, args, kwargs):
        if tuner.queuing_only():
            queued.append(dict(zip(autotuner.arg_names, args))["split_k"])
        return real_queue(autotuner, args, kwargs)

    with mock.patch.object(launch_params, "time_calls_us", lambda calls: (calls[0](), 1.0)[1]), \
            mock.patch.object(tuner, "parallel_compile_available", return_value=True), \
            mock.patch.object(tuner, "_queue_compiles", recording), \
            autotune_launch_params() as stats:
        out = launch(2, x, *packed, 32)
    # In the prepass, each split fused and prequantized; K = 1024 has 4 super-blocks: 8 and 16
    # are illegal.
    assert queued == [1, 1, 2, 2, 4, 4]
    assert set(stats.picks[0].times_us) == {(s, p) for s in (1, 2, 4) for p in (False, True)}
    assert_close_to_reference(out, dequant_matmul_reference(x, packed))
