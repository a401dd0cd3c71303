"""Every supported GGUF tensor type, written with the gguf writer, loads back to the right values."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter, quants

from quickdraft.errors import QuickdraftError
from quickdraft.weights import gguf as gguf_io
from quickdraft.quant.blocks import SUPPORTED_TYPES, dequantize
from tests.helpers import F16_FIELDS, random_blocks

BLOCK_TYPES = list(F16_FIELDS)
ROWS, COLS = 8, 512


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A GGUF file holding one tensor of every supported type, and the values each should load as."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    w = GGUFWriter(str(path), "llama")
    expected = {}
    dense = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    w.add_tensor("dense.F32", dense)
    expected["dense.F32"] = dense
    w.add_tensor("dense.F16", dense.astype(np.float16))
    expected["dense.F16"] = dense.astype(np.float16).astype(np.float32)
    bf16 = quants.quantize(dense, T.BF16)
    w.add_tensor("dense.BF16", bf16, raw_dtype=T.BF16)
    expected["dense.BF16"] = quants.dequantize(bf16, T.BF16)
    for qtype in BLOCK_TYPES:
        raw = random_blocks(qtype, ROWS, COLS, rng)
        w.add_tensor(f"q.{qtype.name}", raw, raw_dtype=qtype)
        expected[f"q.{qtype.name}"] = quants.dequantize(raw, qtype)  # the format's reference decoder
    q8 = quants.quantize(dense, T.Q8_0)  # real values through a real quantizer
    w.add_tensor("real.Q8_0", q8, raw_dtype=T.Q8_0)
    expected["real.Q8_0"] = dense
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, expected


def load_all(path):
    reader = gguf_io.open_gguf(path)
    out = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        out[t.name] = (t.tensor_type, dequantize(t.data, t.tensor_type, shape, torch.float32))
    return out


def test_every_supported_type_is_covered(written):
    _, expected = written
    names = {n.split(".")[1] for n in expected}
    assert names == {t.name for t in SUPPORTED_TYPES}


def test_types_load_back(written):
    path, expected = written
    loaded = load_all(path)
    for name, want in expected.items():
        qtype, got = loaded[name]
        assert got.shape == (ROWS, COLS), name
        if name == "real.Q8_0":  # quantization error of 8-bit blocks: under 1% of each block's range
            assert np.abs(got.numpy() - want).max() < 0.01 * np.abs(want).max(), name
        else:
            np.testing.assert_array_equal(got.numpy(), want, err_msg=name)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequant_matches_reference_on_many_blocks(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, 64, 1024, rng)
    ours = dequantize(raw, qtype, (64, 1024), torch.float32).numpy()
    np.testing.assert_array_equal(ours, quants.dequantize(raw, qtype))


def test_dequant_into_bfloat16():
    rng = np.random.default_rng(1)
    raw = random_blocks(T.Q4_K, 4, 256, rng)
    ours = dequantize(raw, T.Q4_K, (4, 256), torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), torch.from_numpy(quants.dequantize(raw, T.Q4_K)), rtol=1e-2, atol=1e-3)


def test_unsupported_type_is_a_clear_error():
    raw = np.zeros((1, GGML_QUANT_SIZES[T.Q2_K][1]), dtype=np.uint8)
    with pytest.raises(QuickdraftError, match="unsupported tensor type Q2_K"):
        dequantize(raw, T.Q2_K, (256,), torch.float32)


def test_file_rows_slice_as_the_whole_tensor_does(written):
    """The lazy rows a quantizing loader reads block by block are the rows of the eager tensor."""
    path, _ = written
    reader = gguf_io.open_gguf(path)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        whole = dequantize(t.data, t.tensor_type, shape, torch.bfloat16)
        rows = gguf_io.FileRows(t.data, t.tensor_type, shape, torch.bfloat16)
        assert rows.shape == whole.shape and rows.dim() == 2
        parts = [rows[i:i + 3] for i in range(0, ROWS, 3)]  # blocks of 3 rows: the last one short
        assert torch.equal(torch.cat(parts), whole), t.name
        assert torch.equal(rows.full(), whole), t.name


def test_metadata_reads_as_the_gguf_packages_reader_reads_it(tmp_path):
    """quickdraft reads the key/value section itself (the package's reader takes seconds over a vocabulary): every
    value type, arrays of each, and the alignment the data follows, against gguf.GGUFReader."""
    from gguf import GGUFReader, GGUFValueType as V

    path = tmp_path / "meta.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    for kind in (V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.FLOAT32, V.UINT64, V.INT64, V.FLOAT64):
        w.add_key_value(f"t.{kind.name}", 7 if "INT" in kind.name else -1.5, kind)
        w.add_key_value(f"t.{kind.name}.array", [1, 2, 3] if "INT" in kind.name else [0.25, -3.0], V.ARRAY,
                        sub_type=kind)
    w.add_bool("t.bool", True)
    w.add_array("t.bools", [True, False])
    w.add_string("t.text", "zwölf ✓")
    w.add_array("t.texts", ["a", "", "ß", "\u2581x"])
    w.add_tensor("x", np.arange(32, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    ours, theirs = gguf_io.open_gguf(path), GGUFReader(path)
    assert gguf_io.metadata(ours) == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.data_offset == theirs.data_offset and ours.data_offset % 64 == 0
    assert ours.tensors[0].data.tolist() == list(range(32))


@pytest.mark.slow
def test_a_real_vocabularys_metadata_reads_as_the_gguf_packages_reader_reads_it(real_model_path):
    from gguf import GGUFReader

    path = real_model_path("smollm2-135m")  # 49,152 tokens, types and 48,900 merges (the gguf reader takes 2 s)
    theirs = GGUFReader(path)
    assert gguf_io.metadata(gguf_io.open_gguf(path)) == {k: f.contents() for k, f in theirs.fields.items()
                                                         if not k.startswith("GGUF.")}
