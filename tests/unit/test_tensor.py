"""CudaCoalescedInt4Tensor: construction, dequantize, the aten ops it promises (each keeps the
format and the bits), serialization with torch.load(weights_only=True), clear errors, and
torch.compile's cache telling versions of the package apart."""

import io
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torchao.quantization import Int4Tensor
from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

import coalesced_int4
from coalesced_int4 import CudaCoalescedInt4Tensor
from coalesced_int4.quantize import dequantize_packed, pack_nibbles
from tests.helpers import random_weight, run_compiling_python


@pytest.fixture
def weight():
    return CudaCoalescedInt4Tensor.from_float(random_weight(96, 768, seed=1))


def _same_bits(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.packed, b.packed))


def test_from_float_stores_the_five_tensors_with_their_attributes(weight):
    assert weight.shape == (96, 768) and weight.dtype == torch.bfloat16
    assert weight.block_size == [1, 32] and not weight.requires_grad
    expected = {"qdata": (torch.uint8, (96, 384)), "scale": (torch.uint8, (96, 24)),
                "scale_step": (torch.float16, (96, 3)), "zero_point": (torch.uint8, (96, 24)),
                "zero_point_step": (torch.float16, (96, 3))}
    for name, (dtype, shape) in expected.items():
        t = getattr(weight, name)
        assert (t.dtype, tuple(t.shape), t.is_contiguous()) == (dtype, shape, True), name
    assert "shape=(96, 768)" in repr(weight) and "CudaCoalescedInt4Tensor" in repr(weight)


def test_dequantize_is_the_exact_fp32_value_cast_once(weight):
    exact = dequantize_packed(weight.packed, torch.float32)
    assert torch.equal(weight.dequantize(torch.float32), exact)
    assert torch.equal(weight.dequantize(), exact.to(torch.bfloat16))


def test_from_int4_tensor_reencodes_torchao_min_max_weights():
    w = random_weight(64, 512, seed=4, dtype=torch.float32)
    scale, zero = choose_qparams_affine(
        w, MappingType.ASYMMETRIC, [1, 32], torch.int8, quant_min=0, quant_max=15,
        scale_dtype=torch.bfloat16, zero_point_dtype=torch.bfloat16)
    q = quantize_affine(w, [1, 32], scale, zero, torch.int8, quant_min=0, quant_max=15)
    int4 = Int4Tensor(pack_nibbles(q.to(torch.uint8)), scale.t().contiguous(),
                      zero.t().contiguous(), [1, 32], w.shape)
    converted = CudaCoalescedInt4Tensor.from_int4_tensor(int4)
    assert _same_bits(converted, CudaCoalescedInt4Tensor.from_float(w, qparams="minmax"))


def test_from_int4_tensor_refuses_another_zero_point_convention():
    int4 = Int4Tensor(torch.zeros(8, 128, dtype=torch.uint8), torch.ones(8, 8, dtype=torch.bfloat16),
                      torch.full((8, 8), 0.5, dtype=torch.bfloat16), [1, 32], torch.Size([8, 256]))
    with pytest.raises(ValueError, match="integer zero points in \\[0, 15\\]"):
        CudaCoalescedInt4Tensor.from_int4_tensor(int4)


@pytest.mark.parametrize("op", ["detach", "clone", "alias", "contiguous", "to_cpu"])
def test_copying_ops_keep_the_format_and_the_bits(weight, op):
    result = {
        "detach": weight.detach, "clone": weight.clone, "contiguous": weight.contiguous,
        "alias": lambda: torch.ops.aten.alias(weight), "to_cpu": lambda: weight.to("cpu"),
    }[op]()
    assert isinstance(result, CudaCoalescedInt4Tensor) and _same_bits(result, weight)
    assert result.shape == weight.shape and result.block_size == weight.block_size


def test_clone_owns_its_storage(weight):
    copy = weight.clone()
    copy.qdata.zero_()
    assert weight.qdata.any()


def test_copy_between_equal_shapes_copies_the_bits(weight):
    other = CudaCoalescedInt4Tensor.from_float(random_weight(96, 768, seed=9))
    other.copy_(weight)
    assert _same_bits(other, weight)
    with pytest.raises(ValueError, match="metadata mismatch"):
        CudaCoalescedInt4Tensor.from_float(random_weight(32, 768)).copy_(weight)


@pytest.mark.parametrize("rows", [(0, 96), (5, 37), (95, 96), (-20, 96)])
def test_slicing_n_takes_any_rows(weight, rows):
    start, end = rows
    part = weight[start:end]
    assert isinstance(part, CudaCoalescedInt4Tensor) and part.shape == (len(range(96)[start:end]), 768)
    assert torch.equal(part.dequantize(), weight.dequantize()[start:end])


@pytest.mark.parametrize("cols", [(0, 256), (256, 768), (512, 768)])
def test_slicing_k_at_super_block_boundaries(weight, cols):
    start, end = cols
    part = weight[:, start:end]
    assert part.shape == (96, end - start)
    assert torch.equal(part.dequantize(), weight.dequantize()[:, start:end])
    assert torch.equal(weight.narrow(1, start, end - start).dequantize(), part.dequantize())


def test_slices_are_views_so_narrow_copy_loads_a_shard_in_place(weight):
    target = CudaCoalescedInt4Tensor.from_float(torch.zeros(96, 768))
    target.narrow(0, 32, 32).copy_(weight[32:64])
    assert torch.equal(target.dequantize()[32:64], weight.dequantize()[32:64])
    assert torch.equal(target.dequantize()[:32], torch.zeros(32, 768, dtype=torch.bfloat16))


def test_slicing_k_off_a_super_block_boundary_is_refused(weight):
    with pytest.raises(NotImplementedError, match="to a multiple of 256 or K's end, got \\[0, 100\\) of K=768"):
        weight[:, :100]


def test_a_k_off_the_super_blocks_is_stored_padded_and_sliced_to_its_end():
    dense = torch.randn(40, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weight = CudaCoalescedInt4Tensor.from_float(dense)
    assert weight.shape == (40, 576) and weight.qdata.shape == (40, 384) and weight.scale_step.shape == (40, 3)
    # The stored tail is zero and the logical columns are the weight padded with zero columns.
    padded = CudaCoalescedInt4Tensor.from_float(torch.nn.functional.pad(dense, (0, 192)))
    assert all(torch.equal(a, b) for a, b in zip(weight.packed, padded.packed))
    assert torch.equal(weight.dequantize(), padded.dequantize()[:, :576])
    assert (padded.dequantize()[:, 576:] == 0).all()
    x = torch.randn(3, 576).to(torch.bfloat16)
    assert torch.equal(F.linear(x, weight), F.linear(x, weight.dequantize()))
    tail = weight[:, 256:]
    assert tail.shape == (40, 320) and tail.qdata.shape == (40, 256)
    assert torch.equal(tail.dequantize(), weight.dequantize()[:, 256:])
    assert torch.equal(tail[:, 256:].dequantize(), weight.dequantize()[:, 512:])
    with pytest.raises(NotImplementedError, match=r"got \[0, 300\) of K=320"):
        tail[:, :300]


def test_split_and_chunk_take_n_at_any_row_and_k_at_super_blocks_as_views(weight):
    dense = weight.dequantize()
    rows = weight.chunk(3, dim=0)
    assert [r.shape[0] for r in rows] == [32, 32, 32]
    assert all(torch.equal(r.dequantize(), d) for r, d in zip(rows, dense.chunk(3, dim=0)))
    columns = weight.split([256, 512], dim=1)
    assert all(torch.equal(c.dequantize(), d) for c, d in zip(columns, dense.split([256, 512], dim=1)))
    assert rows[1].qdata.untyped_storage().data_ptr() == weight.qdata.untyped_storage().data_ptr()
    uneven = weight.split(40, dim=0)
    assert [u.shape[0] for u in uneven] == [40, 40, 16]
    with pytest.raises(NotImplementedError, match=r"got \[0, 300\) of K=768"):
        weight.split(300, dim=1)


def test_cat_rejoins_parts_bit_for_bit_along_n_and_along_k():
    weight = CudaCoalescedInt4Tensor.from_float(random_weight(64, 576, seed=4))  # K stored padded to 768
    assert _same_bits(torch.cat(weight.chunk(2, dim=0), dim=0), weight)
    joined = torch.cat(weight.split([512, 64], dim=1), dim=1)
    assert joined.shape == (64, 576) and _same_bits(joined, weight)
    with pytest.raises(NotImplementedError, match="every part but the last to hold whole super-blocks"):
        torch.cat([weight, weight[:, :256]], dim=1)
    with pytest.raises(RuntimeError, match="cat along N needs equal K"):
        torch.cat([weight, weight[:, :256]], dim=0)


def test_a_view_is_as_its_own_shape_only(weight):
    assert _same_bits(weight.view(96, 768), weight) and weight.view(-1, 768).shape == (96, 768)
    with pytest.raises(NotImplementedError, match="views only as its own shape"):
        weight.view(768, 96)


def test_the_transpose_runs_the_linear_through_mm_and_addmm(weight):
    """DTensor writes F.linear(x, w) as mm(x, w.t()) (addmm with a bias)."""
    from coalesced_int4.transposed import TransposedInt4Weight

    x, bias = torch.randn(3, 768).to(torch.bfloat16), torch.randn(96).to(torch.bfloat16)
    transposed = weight.t()
    assert isinstance(transposed, TransposedInt4Weight) and transposed.shape == (768, 96)
    assert transposed.weight is weight  # so mm reaches the eager plans kept for this weight object
    assert torch.equal(transposed.dequantize(), weight.dequantize().t())
    assert torch.equal(torch.mm(x, transposed), F.linear(x, weight))
    assert torch.equal(torch.addmm(bias, x, transposed), F.linear(x, weight, bias))
    assert _same_bits(transposed.t(), weight) and transposed.t().shape == weight.shape
    with pytest.raises(NotImplementedError, match="TransposedInt4Weight does not implement aten.add"):
        transposed + 1


def test_from_stored_reads_a_shards_shape_from_its_stored_tensors(weight):
    """transformers' tensor-parallel loading slices each stored tensor and keeps the whole
    weight's metadata."""
    build = CudaCoalescedInt4Tensor.from_stored
    rows = build(*(t[:32] for t in weight.packed), block_size=[1, 32], shape=[96, 768])
    assert rows.shape == (32, 768) and torch.equal(rows.dequantize(), weight.dequantize()[:32])
    half = weight[:, 256:512]
    columns = build(*half.packed, block_size=[1, 32], shape=[96, 768])
    assert columns.shape == (96, 256) and torch.equal(columns.dequantize(), half.dequantize())
    assert build(*weight.packed, block_size=[1, 32], shape=[96, 768]).shape == (96, 768)
    qdata, *rest = weight.packed
    with pytest.raises(ValueError, match="disagree on its rows"):
        build(qdata[:, :64], *rest, block_size=[1, 32], shape=[96, 768])  # a shard splitting super-blocks
    padded = CudaCoalescedInt4Tensor.from_float(random_weight(8, 576))
    with pytest.raises(ValueError, match="only where K is a multiple of 256"):
        build(*padded[:, :512].packed, block_size=[1, 32], shape=[8, 576])


def test_an_uninitialised_copy_is_refused_naming_how_to_shard(weight):
    with pytest.raises(NotImplementedError, match="src_data_rank=None"):
        torch.empty_like(weight)


@pytest.mark.parametrize("op", [lambda w: w + 1, lambda w: w.transpose(0, 1), lambda w: w.sum(),
                                lambda w: w @ w.new_ones(768)])
def test_other_ops_say_which_op_and_to_dequantize(weight, op):
    with pytest.raises(NotImplementedError, match=r"does not implement aten\..*dequantize\(\)"):
        op(weight)


def test_state_dict_round_trips_through_torch_load_weights_only(weight):
    buffer = io.BytesIO()
    torch.save({"w": weight}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["w"]
    assert isinstance(loaded, CudaCoalescedInt4Tensor) and _same_bits(loaded, weight)
    assert vars(loaded).keys() == vars(weight).keys()  # the pickled source hash is not kept


def test_pickling_drops_the_unpicklable_caches_torch_drops(weight):
    # torch caches a wrapper subclass's custom sizes in PyCapsules in its __dict__ and clears
    # them from the dict it pickles; __getstate__ pickles a copy, so it must clear them too.
    weight.__dict__["_sym_sizes_capsule"] = lambda: None  # unpicklable, like a capsule
    buffer = io.BytesIO()
    torch.save({"w": weight}, buffer)
    buffer.seek(0)
    assert _same_bits(torch.load(buffer, weights_only=True)["w"], weight)


_COMPILE_A_QUANTIZED_LINEAR = """
import torch, coalesced_int4
torch.manual_seed(0)
linear = torch.nn.Linear(256, 64, bias=False, dtype=torch.bfloat16)
coalesced_int4.quantize_(linear, coalesced_int4.int4_config())
x = torch.randn(3, 256, dtype=torch.bfloat16)
print(coalesced_int4.__file__, torch.equal(torch.compile(linear, fullgraph=True)(x), linear(x)))
"""


def test_a_graph_compiled_by_another_version_of_the_package_is_not_reused(tmp_path, monkeypatch):
    # torch.compile's AOTAutograd cache keys a graph before the weight's ops are traced, on
    # the weight's _stable_hash_for_caching (torch 2.13) or its pickled state (torch 2.11,
    # which has no such hook): a version of the package whose dispatch computes
    # something else (here twice the product) must compile its own graph, not be served the
    # graph the first version left in the cache.
    package = Path(coalesced_int4.__file__).parent
    other = tmp_path / "other"
    shutil.copytree(package, other / "coalesced_int4", ignore=shutil.ignore_patterns("__pycache__"))
    dispatch = other / "coalesced_int4" / "dispatch" / "linear.py"
    source = dispatch.read_text()
    assert source.count("return F.linear(x_2d, dequantize") == 1
    dispatch.write_text(source.replace("return F.linear(x_2d, dequantize", "return 2 * F.linear(x_2d, dequantize"))
    monkeypatch.chdir(tmp_path)  # python -c puts its working directory first on the path
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    for root in (package.parent, other):
        run = run_compiling_python(_COMPILE_A_QUANTIZED_LINEAR, path=(str(root),))
        assert run.returncode == 0, run.stderr[-2000:]
        imported, compiled_equals_eager = run.stdout.split()[-2:]
        assert Path(imported).parent == root / "coalesced_int4"
        assert compiled_equals_eager == "True", root
