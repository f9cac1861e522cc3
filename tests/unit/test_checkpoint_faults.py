"""Fault injection: checkpoints, converter inputs and activations that must not hurt the user.
Each case gets the correct result or a one-line error naming the file, the tensor and the rule,
raised before anything is modified; a crash at any step of a save leaves a directory that loads
as the old or the new checkpoint, and the next save removes what the crash left."""

import json
import struct

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import coalesced_int4 as ci4
from coalesced_int4 import CudaCoalescedInt4Tensor, int4_config
from coalesced_int4.cli import main
from coalesced_int4.serialization import CheckpointError
from coalesced_int4.serialization import writer as writer_module
from tests.helpers import rewrite_safetensors

INDEX = "model.safetensors.index.json"


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(256, 512, bias=False)
        self.down = torch.nn.Linear(512, 256, bias=False)
        self.norm = torch.nn.LayerNorm(256)


def _model(seed=0):
    torch.manual_seed(seed)
    model = Tiny().to(torch.bfloat16)
    ci4.quantize_(model, int4_config())
    return model


def _meta_model():
    with torch.device("meta"):
        return Tiny().to(torch.bfloat16)


def _same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, CudaCoalescedInt4Tensor):
            assert all(torch.equal(p, q) for p, q in zip(x.packed, y.packed)), name
        else:
            assert torch.equal(x, y), name
    return True


def _edit_header(path, edit):
    """Rewrite a safetensors file's JSON header in place (padded to its old length)."""
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size
    path.write_bytes(data[:8] + text.ljust(size) + data[8 + size:])


@pytest.fixture
def saved(tmp_path):
    ci4.save_quantized(_model(), tmp_path / "ckpt")
    return tmp_path / "ckpt" / "model.safetensors"


@pytest.fixture
def sharded(tmp_path):
    ci4.save_quantized(_model(), tmp_path / "ckpt", max_shard_size="40KB")
    return tmp_path / "ckpt"


@pytest.fixture
def dense_source(tmp_path):
    """A Hugging Face-style dense checkpoint directory with a config and a tokenizer file."""
    source = tmp_path / "dense"
    source.mkdir()
    torch.manual_seed(0)
    save_file({"layer.weight": torch.randn(64, 256).to(torch.bfloat16),
               "embed.weight": torch.randn(10, 256).to(torch.bfloat16)}, str(source / "model.safetensors"))
    (source / "config.json").write_text('{"model_type": "tiny"}')
    (source / "tokenizer.json").write_text("{}")
    return source


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ------------------------------------------------------------ never delete or escape


def test_saving_over_a_foreign_single_file_is_refused_and_leaves_it(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"model.safetensors: refusing to overwrite a file this library did not"):
        ci4.save_quantized(_model(), tmp_path)
    assert _snapshot(tmp_path) == before


def test_saving_over_a_foreign_index_deletes_none_of_the_files_it_names(tmp_path):
    for name in ("config.json", "README.md", "model-00001-of-00002.safetensors"):
        (tmp_path / name).write_text(name)
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "config.json", "b": "README.md", "c": "model-00001-of-00002.safetensors"}}))
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"index.json: refusing to save over a checkpoint this library did not"):
        ci4.save_quantized(_model(), tmp_path)
    assert _snapshot(tmp_path) == before


def test_a_tampered_index_of_ours_cannot_make_a_save_delete_other_files(sharded):
    (sharded / "config.json").write_text("{}")
    (sharded / "README.md").write_text("hello")
    index = json.loads((sharded / INDEX).read_text())
    index["weight_map"]["extra1"] = "config.json"
    index["weight_map"]["extra2"] = "README.md"
    (sharded / INDEX).write_text(json.dumps(index))
    ci4.save_quantized(_model(seed=3), sharded)
    assert (sharded / "config.json").read_text() == "{}" and (sharded / "README.md").read_text() == "hello"


@pytest.mark.parametrize("entry", ["../other/model.safetensors", "/etc/passwd", "sub/model.safetensors", "..",
                                   5, None, "config.json"])
def test_index_entries_must_be_plain_safetensors_names_in_the_directory(sharded, entry):
    index = json.loads((sharded / INDEX).read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = entry
    (sharded / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"index.json: tensor '{key}' maps to .*plain"):
        ci4.load_state_dict(sharded)


def test_an_index_with_an_empty_weight_map_is_an_error(sharded):
    (sharded / INDEX).write_text(json.dumps({"metadata": {"format": "coalesced_int4"}, "weight_map": {}}))
    with pytest.raises(CheckpointError, match="weight_map must be a non-empty object"):
        ci4.load_state_dict(sharded)


def test_the_index_file_itself_may_be_passed_as_the_path(sharded):
    assert _same(ci4.load_state_dict(sharded / INDEX), ci4.load_state_dict(sharded))


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"notes.txt: not a checkpoint"):
        ci4.load_state_dict(tmp_path / "notes.txt")


# ------------------------------------------------------------ crash at every commit step


def _count_commit_steps(monkeypatch, directory, model, shard_size):
    calls = []
    real_replace, real_remove = writer_module.os.replace, writer_module._remove
    monkeypatch.setattr(writer_module.os, "replace", lambda *a: (calls.append("replace"), real_replace(*a))[1])
    monkeypatch.setattr(writer_module, "_remove", lambda *a: (calls.append("remove"), real_remove(*a))[1])
    ci4.save_quantized(model, directory, max_shard_size=shard_size)
    monkeypatch.undo()
    return len(calls)


class Crash(BaseException):
    """The process dying: nothing after the crash point runs, cleanup included."""


TRANSITIONS = [("5GB", "5GB"), ("5GB", "40KB"), ("40KB", "5GB"), ("40KB", "60KB"), ("40KB", "40KB")]


@pytest.mark.parametrize("old_size, new_size", TRANSITIONS)
def test_a_crash_at_any_commit_step_leaves_the_old_or_the_new_checkpoint(tmp_path, monkeypatch, old_size, new_size):
    old, new, newer = _model(seed=1), _model(seed=2), _model(seed=3)
    probe = tmp_path / "probe"
    ci4.save_quantized(old, probe, max_shard_size=old_size)
    steps = _count_commit_steps(monkeypatch, probe, new, new_size)
    assert steps >= 2
    outcomes = []
    for crash_at in range(steps):
        directory = tmp_path / f"crash{crash_at}"
        ci4.save_quantized(old, directory, max_shard_size=old_size)
        calls = {"n": 0}
        real_replace, real_remove = writer_module.os.replace, writer_module._remove

        def step(real):
            def run(*args):
                if calls["n"] == crash_at:
                    raise Crash()
                calls["n"] += 1
                return real(*args)
            return run

        monkeypatch.setattr(writer_module.os, "replace", step(real_replace))
        monkeypatch.setattr(writer_module, "_remove", step(real_remove))
        monkeypatch.setattr(writer_module.ShardWriter, "abort", lambda self: None)
        with pytest.raises(Crash):
            ci4.save_quantized(new, directory, max_shard_size=new_size)
        monkeypatch.undo()
        loaded = ci4.load_state_dict(directory)
        outcomes.append("old" if _matches(loaded, old) else "new" if _matches(loaded, new) else "neither")
        assert outcomes[-1] != "neither", f"crash at step {crash_at}"
        # The next save removes whatever the crash left behind.
        ci4.save_quantized(newer, directory, max_shard_size=new_size)
        names = {p.name for p in directory.iterdir()}
        assert not any(name.endswith(".tmp") for name in names), names
        expected = {"model.safetensors"} if new_size == "5GB" else \
            {INDEX, *json.loads((directory / INDEX).read_text())["weight_map"].values()}
        assert names == expected, f"crash at step {crash_at}: {names}"
        assert _same(ci4.load_state_dict(directory), newer.state_dict())
    assert outcomes[0] == "old" and outcomes[-1] == "new", outcomes


def _matches(loaded, model):
    try:
        return _same(loaded, model.state_dict())
    except AssertionError:
        return False


def test_temporaries_of_a_killed_save_are_removed_by_the_next_save(sharded):
    (sharded / ".shard0.0123456789ab.tmp").write_bytes(b"partial")
    (sharded / ".index.0123456789ab.tmp").write_text("{")
    (sharded / "model-00001-of-00009.0123456789ab.safetensors").write_bytes(b"orphan")
    (sharded / "keep.tmp").write_text("not ours")
    ci4.save_quantized(_model(seed=4), sharded, max_shard_size="40KB")
    names = {p.name for p in sharded.iterdir()}
    assert "keep.tmp" in names
    assert not {".shard0.0123456789ab.tmp", ".index.0123456789ab.tmp",
                "model-00001-of-00009.0123456789ab.safetensors"} & names


def test_saving_into_a_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        ci4.save_quantized(_model(), tmp_path / "file")


# ------------------------------------------------------------ silent wrong results


@pytest.fixture(scope="module")
def weight():
    return CudaCoalescedInt4Tensor.from_float(torch.randn(64, 256).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_a_non_floating_activation_raises_as_dense_does(weight, dtype):
    x = torch.ones(2, 256, dtype=dtype)
    with pytest.raises(RuntimeError):
        F.linear(x, torch.ones(64, 256, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=f"the input is {dtype}; it must be floating point"):
        F.linear(x, weight)


@pytest.mark.parametrize("rows", [0, 3])
def test_a_wrong_k_raises_even_with_no_rows(weight, rows):
    with pytest.raises(RuntimeError, match="last dimension is 128 but the weight's K .* is 256"):
        F.linear(torch.ones(rows, 128, dtype=torch.bfloat16), weight)


def test_a_zero_d_activation_raises(weight):
    with pytest.raises(RuntimeError, match="the input is 0-D"):
        F.linear(torch.tensor(1.0, dtype=torch.bfloat16), weight)


@pytest.mark.parametrize("component, value", [("scale_step", float("nan")), ("zero_point_step", float("inf")),
                                              ("scale_step", -1.0)])
def test_steps_that_are_not_finite_and_non_negative_are_refused_at_load(saved, component, value):
    def poison(tensors):
        steps = tensors[f"up._weight_{component}"].clone()
        steps[3, 0] = value
        tensors[f"up._weight_{component}"] = steps

    rewrite_safetensors(saved, edit_tensors=poison)
    with pytest.raises(CheckpointError, match=rf"{saved}: tensor 'up._weight_{component}' of 'up.weight' holds NaN"):
        ci4.load_state_dict(saved.parent)


@pytest.mark.parametrize("stored", ["F16", "I16"])
def test_a_plain_tensor_stored_in_another_dtype_is_refused_before_anything_loads(saved, stored):
    _edit_header(saved, lambda h: h["norm.weight"].update(dtype=stored))
    model = _meta_model()
    with pytest.raises(CheckpointError, match=r"'norm.weight' is stored as torch\.(float16|int16) but module 'norm'"):
        ci4.load_quantized(model, saved.parent)
    assert all(t.is_meta for t in model.state_dict().values())


def test_cast_loads_a_plain_tensor_of_another_dtype_in_the_modules_dtype(saved):
    with torch.device("meta"):
        model = Tiny()  # fp32 norm, the checkpoint's is bf16
    ci4.load_quantized(model, saved.parent, cast=True)
    assert model.norm.weight.dtype == torch.float32


@pytest.mark.parametrize("dtype_name", ["int8", "float32", "load"])
def test_an_activation_dtype_other_than_bf16_is_refused(saved, dtype_name):
    def edit(meta):
        entry = json.loads(meta["up.weight"])
        entry["_data"]["activation_dtype"]["_data"] = dtype_name
        meta["up.weight"] = json.dumps(entry)

    rewrite_safetensors(saved, edit_meta=edit)
    with pytest.raises(CheckpointError, match=rf"'up.weight' declares activation_dtype '{dtype_name}'"):
        ci4.load_state_dict(saved.parent)


def test_swapped_offsets_of_two_same_shape_components_fail_verification(saved):
    def swap(header):
        a, b = header["up._weight_scale"], header["up._weight_zero_point"]
        a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]

    _edit_header(saved, swap)
    ci4.load_state_dict(saved.parent)  # without verification the swap is not visible
    with pytest.raises(CheckpointError, match=r"tensor 'up._weight_(scale|zero_point)' of 'up.weight' fails its checksum"):
        ci4.load_state_dict(saved.parent, verify=True)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        ci4.load_quantized(_meta_model(), saved.parent, verify=True)


def test_verify_passes_on_an_intact_checkpoint(sharded, capsys):
    model = _meta_model()
    ci4.load_quantized(model, sharded, verify=True)
    assert main(["inspect", str(sharded), "--verify"]) == 0
    assert "verified: " in capsys.readouterr().out


def test_verify_of_a_file_without_checksums_says_so(saved):
    rewrite_safetensors(saved, edit_meta=lambda m: m.pop("checksums"))
    ci4.load_state_dict(saved.parent)
    with pytest.raises(CheckpointError, match="no readable checksums to verify against"):
        ci4.load_state_dict(saved.parent, verify=True)


def test_a_stored_tensor_no_entry_claims_is_an_error(saved):
    rewrite_safetensors(saved, edit_tensors=lambda t: t.update(stray=torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"tensor 'stray' is stored but its header lists no entry"):
        ci4.load_state_dict(saved.parent)


@pytest.mark.parametrize("version", ["²", "1.0", "-1", ""])
def test_unreadable_format_versions_are_named(saved, version):
    rewrite_safetensors(saved, edit_meta=lambda m: m.update(coalesced_int4_version=version))
    with pytest.raises(CheckpointError, match=rf"{saved}: unreadable coalesced_int4_version"):
        ci4.load_state_dict(saved.parent)


# ------------------------------------------------------------ the converter and the CLI


def _cli_error(capsys, *argv):
    """Run the CLI; it must exit 2 with one ``error:`` line and no traceback."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_quantize_src_into_itself_is_refused_and_the_source_is_untouched(dense_source, capsys):
    before = _snapshot(dense_source)
    assert "overlap" in _cli_error(capsys, "quantize", str(dense_source), str(dense_source))
    assert _snapshot(dense_source) == before


@pytest.mark.parametrize("layout", ["file-into-parent", "dst-inside-src", "src-inside-dst"])
def test_quantize_paths_may_not_overlap_in_either_direction(dense_source, capsys, layout):
    src, dst = {
        "file-into-parent": (dense_source / "model.safetensors", dense_source),
        "dst-inside-src": (dense_source, dense_source / "out"),
        "src-inside-dst": (dense_source, dense_source.parent),
    }[layout]
    assert "overlap" in _cli_error(capsys, "quantize", str(src), str(dst))
    assert not (dense_source / "out").exists()


def test_quantize_into_a_file_is_refused(dense_source, tmp_path, capsys):
    (tmp_path / "out").write_text("x")
    assert "is a file" in _cli_error(capsys, "quantize", str(dense_source), str(tmp_path / "out"))


def test_quantize_names_the_file_and_tensor_of_a_weight_with_nan(dense_source, tmp_path, capsys):
    weight = torch.randn(64, 256).to(torch.bfloat16)
    weight[5, 7] = float("nan")
    save_file({"layer.weight": weight}, str(dense_source / "model.safetensors"))
    err = _cli_error(capsys, "quantize", str(dense_source), str(tmp_path / "out"))
    assert "model.safetensors: tensor 'layer.weight' cannot be quantized" in err and "NaN" in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_quantize_names_a_source_that_is_not_safetensors(dense_source, tmp_path, capsys, damage):
    file = dense_source / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100] if damage == "truncated" else b"not a safetensors file at all")
    err = _cli_error(capsys, "quantize", str(dense_source), str(tmp_path / "out"))
    assert f"{file}: not a readable safetensors file" in err


def test_quantize_refuses_a_source_that_is_already_quantized(sharded, tmp_path, capsys):
    assert "already a coalesced_int4 checkpoint" in _cli_error(capsys, "quantize", str(sharded), str(tmp_path / "q2"))
    assert not (tmp_path / "q2").exists()


def test_quantize_names_an_fp8_weight(dense_source, tmp_path, capsys):
    save_file({"layer.weight": torch.randn(64, 256).to(torch.float8_e4m3fn)}, str(dense_source / "model.safetensors"))
    err = _cli_error(capsys, "quantize", str(dense_source), str(tmp_path / "out"))
    assert "tensor 'layer.weight' is F8_E4M3" in err


def test_quantize_never_overwrites_a_different_side_file_in_dst(dense_source, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    assert "config.json: exists and differs" in _cli_error(capsys, "quantize", str(dense_source), str(out))
    assert (out / "config.json").read_text() == '{"mine": true}'
    assert not (out / "model.safetensors").exists()


def test_inspect_against_a_source_of_other_shapes_names_the_tensor(dense_source, tmp_path, capsys):
    assert main(["quantize", str(dense_source), str(tmp_path / "out")]) == 0
    other = tmp_path / "other"
    other.mkdir()
    save_file({"layer.weight": torch.randn(32, 256).to(torch.bfloat16)}, str(other / "model.safetensors"))
    capsys.readouterr()
    err = _cli_error(capsys, "inspect", str(tmp_path / "out"), "--error", str(other))
    assert "tensor 'layer.weight' is [32, 256] in the dense source but [64, 256]" in err
