"""save_quantized / load_quantized / load_state_dict: round trips (single file, sharded, meta
device, another device), atomic writes, and a clear error naming the file and tensor for every
malformed input."""

import json
import logging
import re

import pytest
import torch
from safetensors import safe_open

import coalesced_int4 as ci4
from coalesced_int4 import CudaCoalescedInt4Tensor, int4_config
from coalesced_int4.serialization import CheckpointError, parse_size
from coalesced_int4.serialization import writer as writer_module
from tests.helpers import rewrite_safetensors


class Tiny(torch.nn.Module):
    """Every kind of entry: embedding, quantized linears (with and without bias, K stored
    padded: K=96 in 256 columns), a norm, a linear left dense (K=100), a persistent buffer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 256)
        self.up = torch.nn.Linear(256, 512, bias=False)
        self.down = torch.nn.Linear(512, 256)
        self.norm = torch.nn.LayerNorm(256)
        self.narrow = torch.nn.Linear(256, 96)
        self.padded = torch.nn.Linear(96, 100)
        self.head = torch.nn.Linear(100, 32)
        self.register_buffer("offset", torch.arange(4.0))

    def forward(self, tokens):
        h = self.embed(tokens)
        h = self.norm(h + self.down(torch.relu(self.up(h))))
        return self.head(torch.relu(self.padded(torch.relu(self.narrow(h))))) + self.offset.sum()


def _quantized_model(seed=0):
    torch.manual_seed(seed)
    model = Tiny().to(torch.bfloat16)
    ci4.quantize_(model, int4_config())
    return model


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert type(x) is type(y), name
        if isinstance(x, CudaCoalescedInt4Tensor):
            assert all(torch.equal(p, q) for p, q in zip(x.packed, y.packed)), name
            assert x.shape == y.shape and x.block_size == y.block_size
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), name


TOKENS = torch.tensor([[1, 5, 9, 33]])


def test_single_file_round_trip_is_bit_identical(tmp_path):
    model = _quantized_model()
    files = ci4.save_quantized(model, tmp_path)
    assert [f.name for f in files] == ["model.safetensors"]
    _assert_same_state(model.state_dict(), ci4.load_state_dict(tmp_path))
    with safe_open(str(files[0]), framework="pt") as handle:
        meta = handle.metadata()
    assert meta["format"] == "pt" and meta["coalesced_int4_version"] == "1"
    up = json.loads(meta["up.weight"])
    assert up["_type"] == "CudaCoalescedInt4Tensor"
    assert up["_data"]["shape"] == [512, 256] and up["_data"]["block_size"] == [1, 32]
    assert json.loads(meta["padded.weight"])["_data"]["shape"] == [100, 96]
    with safe_open(str(files[0]), framework="pt") as handle:
        assert handle.get_slice("padded._weight_qdata").get_shape() == [100, 128]
    assert json.loads(meta["head.weight"]) == {"_type": "Tensor"}


def test_sharded_round_trip_keeps_each_weight_in_one_shard(tmp_path):
    model = _quantized_model()
    files = ci4.save_quantized(model, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 2
    assert re.fullmatch(rf"model-00001-of-{len(shards):05d}\.[0-9a-f]{{12}}\.safetensors", shards[0]), shards[0]
    assert {f.name for f in files} == set(shards) | {"model.safetensors.index.json"}
    homes = {index["weight_map"][f"up._weight_{c}"] for c in ("qdata", "scale", "scale_step", "zero_point", "zero_point_step")}
    assert len(homes) == 1
    stored = sum(t.numel() * t.element_size() for t in _stored_tensors(tmp_path, shards))
    assert index["metadata"]["total_size"] == stored
    _assert_same_state(model.state_dict(), ci4.load_state_dict(tmp_path))


def _stored_tensors(directory, names):
    for name in names:
        with safe_open(str(directory / name), framework="pt") as handle:
            for key in handle.keys():
                yield handle.get_tensor(key)


def test_meta_device_model_loads_by_assignment_and_gives_identical_outputs(tmp_path):
    model = _quantized_model()
    ci4.save_quantized(model, tmp_path, max_shard_size=30_000)
    with torch.device("meta"):
        fresh = Tiny().to(torch.bfloat16)
    assert ci4.load_quantized(fresh, tmp_path) is fresh
    assert isinstance(fresh.up.weight, CudaCoalescedInt4Tensor) and fresh.up.weight.device.type == "cpu"
    assert not any(t.is_meta for t in fresh.state_dict().values())
    assert torch.equal(fresh(TOKENS), model(TOKENS))


def test_a_dense_model_on_a_real_device_is_replaced_by_the_checkpoint(tmp_path):
    model = _quantized_model()
    ci4.save_quantized(model, tmp_path)
    dense = Tiny().to(torch.bfloat16)
    ci4.load_quantized(dense, tmp_path)
    assert isinstance(dense.down.weight, CudaCoalescedInt4Tensor)
    assert torch.equal(dense(TOKENS), model(TOKENS))


def test_loading_onto_another_device_than_saved(tmp_path):
    ci4.save_quantized(_quantized_model(), tmp_path)
    state = ci4.load_state_dict(tmp_path, device="meta")
    assert all(v.is_meta for v in state.values())
    assert isinstance(state["up.weight"], CudaCoalescedInt4Tensor)


def test_plain_state_dicts_round_trip(tmp_path):
    state = {"a.weight": torch.randn(3, 5), "b": torch.arange(7), "c.bias": torch.ones(2, dtype=torch.float16)}
    ci4.save_quantized(state, tmp_path)
    _assert_same_state(state, ci4.load_state_dict(tmp_path))


def test_user_metadata_is_stored_and_may_not_shadow_the_format(tmp_path):
    files = ci4.save_quantized({"x": torch.ones(1)}, tmp_path, metadata={"model": "tiny"})
    with safe_open(str(files[0]), framework="pt") as handle:
        assert handle.metadata()["model"] == "tiny"
    with pytest.raises(ValueError, match="reserved"):
        ci4.save_quantized({"x": torch.ones(1)}, tmp_path, metadata={"format": "mine"})


@pytest.mark.parametrize("size, expected", [(1000, 1000), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1.5 kb", 1500)])
def test_shard_sizes_parse(size, expected):
    assert parse_size(size) == expected


def test_bad_shard_sizes_are_rejected():
    for size in ("lots", "-5MB", 0, "5PB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(size)


# ---------------------------------------------------------------- atomic writes


def _failing_after(monkeypatch, calls):
    real = writer_module.save_file
    count = {"n": 0}

    def flaky(*args, **kwargs):
        count["n"] += 1
        if count["n"] > calls:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "save_file", flaky)


def test_an_interrupted_save_leaves_nothing_loadable(tmp_path, monkeypatch):
    _failing_after(monkeypatch, calls=2)
    with pytest.raises(OSError, match="disk full"):
        ci4.save_quantized(_quantized_model(), tmp_path, max_shard_size="40KB")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="holds neither"):
        ci4.load_state_dict(tmp_path)


@pytest.mark.parametrize("old_shard_size", ["40KB", "5GB"])
def test_an_interrupted_save_leaves_an_older_checkpoint_intact(tmp_path, monkeypatch, old_shard_size):
    old = _quantized_model(seed=1)
    ci4.save_quantized(old, tmp_path, max_shard_size=old_shard_size)
    before = sorted(p.name for p in tmp_path.iterdir())
    _failing_after(monkeypatch, calls=1)
    with pytest.raises(OSError):
        ci4.save_quantized(_quantized_model(seed=2), tmp_path, max_shard_size="40KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    _assert_same_state(old.state_dict(), ci4.load_state_dict(tmp_path))


def test_a_new_save_replaces_an_older_checkpoint_of_another_layout(tmp_path):
    ci4.save_quantized(_quantized_model(seed=1), tmp_path, max_shard_size="40KB")
    new = _quantized_model(seed=2)
    ci4.save_quantized(new, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    _assert_same_state(new.state_dict(), ci4.load_state_dict(tmp_path))
    ci4.save_quantized(new, tmp_path, max_shard_size="40KB")
    assert "model.safetensors" not in {p.name for p in tmp_path.iterdir()}
    _assert_same_state(new.state_dict(), ci4.load_state_dict(tmp_path))


# ---------------------------------------------------------------- malformed inputs


@pytest.fixture
def saved(tmp_path):
    model = _quantized_model()
    ci4.save_quantized(model, tmp_path)
    return tmp_path / "model.safetensors"


def test_garbage_file(saved):
    saved.write_bytes(b"this is not a safetensors file at all" * 10)
    with pytest.raises(CheckpointError, match=f"{saved}: not a readable safetensors file"):
        ci4.load_state_dict(saved.parent)


def test_truncated_file(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=str(saved)):
        ci4.load_state_dict(saved.parent)


def test_missing_shard(tmp_path):
    ci4.save_quantized(_quantized_model(), tmp_path, max_shard_size="40KB")
    second = next(tmp_path.glob("model-00002-of-00004.*.safetensors"))
    second.unlink()
    with pytest.raises(CheckpointError, match=rf"shard {re.escape(second.name)} is missing \(it holds '"):
        ci4.load_state_dict(tmp_path)


def test_missing_and_unexpected_keys_under_strict(saved, caplog):
    rewrite_safetensors(saved, edit_meta=lambda m: m.update(tensor_names=json.dumps(
        [n for n in json.loads(m["tensor_names"]) if n != "norm.weight"] + ["extra"]),
        extra=json.dumps({"_type": "Tensor"})),
        edit_tensors=lambda t: (t.pop("norm.weight"), t.update(extra=torch.zeros(1))))
    with torch.device("meta"):
        model = Tiny().to(torch.bfloat16)
    with pytest.raises(CheckpointError) as error:
        ci4.load_quantized(model, saved.parent)
    assert "missing from the checkpoint: 'norm.weight'" in str(error.value)
    assert f"unexpected in {saved}: 'extra'" in str(error.value)
    assert model.up.weight.is_meta  # nothing was loaded
    with pytest.raises(CheckpointError, match=r"1 tensors of the model are still on the meta device \(first: 'norm.weight'\)"):
        ci4.load_quantized(model, saved.parent, strict=False)
    real = Tiny().to(torch.bfloat16)
    norm = real.norm.weight.detach().clone()
    with caplog.at_level(logging.WARNING):
        assert ci4.load_quantized(real, saved.parent, strict=False) is real
    assert "missing from the checkpoint: ['norm.weight']; unexpected: ['extra']" in caplog.text
    assert isinstance(real.up.weight, CudaCoalescedInt4Tensor) and torch.equal(real.norm.weight, norm)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.update({"up._weight_scale_step": t["up._weight_scale_step"].float()}),
         r"'up._weight_scale_step' of 'up.weight' is torch.float32 \(512, 1\), expected torch.float16 \(512, 1\)"),
        (lambda t: t.update({"up._weight_qdata": t["up._weight_qdata"][:, :64].contiguous()}),
         r"'up._weight_qdata' of 'up.weight' is torch.uint8 \(512, 64\), expected torch.uint8 \(512, 128\)"),
        (lambda t: t.pop("down._weight_zero_point"),
         r"tensor 'down._weight_zero_point' of 'down.weight' is missing"),
    ],
)
def test_bad_components_name_the_file_and_tensor(saved, edit, message):
    rewrite_safetensors(saved, edit_tensors=edit)
    with pytest.raises(CheckpointError, match=f"{saved}: .*{message}"):
        ci4.load_state_dict(saved.parent)


def test_a_quantized_weight_that_disagrees_with_the_module(saved):
    class Wider(Tiny):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(256, 1024, bias=False)

    with torch.device("meta"):
        model = Wider()
    with pytest.raises(CheckpointError, match=r"'up.weight' has shape \[512, 256\] but module 'up' expects \[1024, 256\]"):
        ci4.load_quantized(model, saved.parent)


@pytest.mark.parametrize(
    "edit, message",
    [(lambda m: m.update(format="torchao"), "not a coalesced_int4 checkpoint"),
     (lambda m: m.update(coalesced_int4_version="2"), "coalesced_int4_version 2 is newer than this library reads"),
     (lambda m: m.update(format="coalesced_int4", format_version="2"), "format_version 2 is newer than this library"),
     (lambda m: m.update({"up.weight": json.dumps({"_type": "Mystery"})}), "'up.weight' has unknown type 'Mystery'")],
)
def test_unknown_formats_and_versions(saved, edit, message):
    rewrite_safetensors(saved, edit_meta=edit)
    with pytest.raises(CheckpointError, match=f"{saved}: .*{message}"):
        ci4.load_state_dict(saved.parent)


def test_no_checkpoint_at_the_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        ci4.load_state_dict(tmp_path / "nowhere")
