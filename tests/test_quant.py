"""The int8 and int4 weight-only paths against their plain references."""

import pytest
import torch

from quickdraft.config import EngineConfig, RopeConfig, SamplingParams
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.quant import avx2, embedding, int4, int8, vnni
from quickdraft.weights import gguf as gguf_io
from quickdraft.weights.loader import load_model
from tests.helpers import save_hf_dir, tiny_hf_config, tiny_hf_model, write_gguf_from_hf


BACKENDS = ["vnni", "torch"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Each layer on quickdraft's VNNI kernel (where this CPU has one) and on PyTorch's op."""
    if request.param == "vnni" and not vnni.available():
        pytest.skip(f"no VNNI kernel here: {vnni.unavailable_reason()}")
    if request.param == "torch":
        monkeypatch.setattr(vnni, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("kind", [int4.Int4Linear, int8.Int8Linear])
def test_kernel_matches_its_reference(backend, kind):
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    layer = kind(w, torch.randn(96))
    assert layer.vnni == (backend == "vnni")
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    if backend == "vnni":  # integer products, then the same float scaling: equal up to bf16 rounding
        torch.testing.assert_close(layer(x).float(), layer.reference(x).float(), rtol=8e-3, atol=1e-2)
    w_ref = layer.dequantized(*([int4.quantize(w)[0]] if kind is int4.Int4Linear and backend == "torch" else []))
    want = x.float() @ w_ref.t() + layer.bias.float()
    # against float activations: on VNNI, within the rounding of the bf16 output and of the int8
    # activations (half a step, max |x| / 254 per row, on each weight at most); PyTorch's ops round
    # their weights to bf16 on the way
    if backend == "vnni":
        bound = 2 ** -8 * want.abs() + 1e-3 + x.float().abs().amax(-1, keepdim=True) / 254 * w_ref.abs().sum(-1)
    else:
        bound = 2e-2 * want.abs() + 0.05
    assert ((layer(x).float() - want).abs() <= bound).all()


def test_quantization_is_faithful(backend):
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    layer = int4.Int4Linear(w, None)
    reference_w = layer.dequantized(int4.quantize(w)[0] if backend == "torch" else None)
    # per group, no worse than min-max rounding, up to the rounding of the stored scales
    groups = w.reshape(96, -1, int4.GROUP)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    min_max = int4._sq_error(groups, (hi - lo) / 15, lo)[..., 0]
    err = ((reference_w - w) ** 2).reshape(96, -1, int4.GROUP).sum(-1)
    slack = 1.02 if backend == "vnni" else 1.15  # float16 or bfloat16 scales
    assert (err <= slack * min_max + 1e-4).all() and err.sum() < min_max.sum()
    layer = int8.Int8Linear(w, None)  # half a step of rounding at most: the step is a row's largest |w| / 127
    assert ((layer.dequantized() - w).abs() <= 0.51 * w.abs().amax(-1, keepdim=True) / 127).all()


@pytest.mark.parametrize("kind", [int4.Int4Linear, int8.Int8Linear])
def test_rows_are_independent_of_batch_size(backend, kind):
    torch.manual_seed(1)
    layer = kind(torch.randn(64, 128), None)
    x = torch.randn(9, 128, dtype=torch.bfloat16)
    full = layer(x)
    assert all(torch.equal(layer(x[i:i + 1])[0], full[i]) for i in range(9))


@pytest.mark.skipif(not vnni.available(), reason="no VNNI kernel on this CPU")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
def test_vnni_kernels_every_row_count(rows):
    """Row tiles of 1-4 and 5-8 and their remainders, several output tiles, K in two blocks (the int8 kernel
    takes K 2048 bytes at a time from 5 rows on), with and without bias, a zero row."""
    torch.manual_seed(rows)
    ops = vnni.ops()
    n, k = 40, 2304
    x = torch.randn(rows, k, dtype=torch.bfloat16) * 3
    x[0] = 0
    if rows > 1:
        x[-1, 7] = 3000  # massive activations: a second level of codes for that row
    bias = torch.randn(n, dtype=torch.bfloat16)
    u = torch.randint(1, 256, (n, k), dtype=torch.uint8)  # q + 128, q in -127..127
    scales = torch.rand(n) * 0.01
    for b in (None, bias):
        got = ops.int8_linear(x, vnni.tile(u, 64), scales, b)
        torch.testing.assert_close(got.float(), vnni.int8_reference(x, u, scales, b).float(), rtol=8e-3, atol=1e-2)
        assert b is not None or (got[0] == 0).all()
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    packed = vnni.pack_int4(codes)
    assert torch.equal(vnni.unpack_int4(packed), codes)
    s, lo = (torch.rand(n, k // 32) * 0.01).half(), (torch.randn(n, k // 32) * 0.05).half()
    for b in (None, bias):
        got = ops.int4_linear(x, vnni.tile(packed, 64), vnni.tile(s, 4), lo, b)
        torch.testing.assert_close(got.float(), vnni.int4_reference(x, packed, s, lo, b).float(), rtol=8e-3,
                                   atol=1e-2)
    assert torch.equal(vnni.untile(vnni.tile(u, 64), 64), u)


@pytest.mark.skipif(not vnni.available(), reason="no VNNI kernel on this CPU")
def test_vnni_kernels_refuse_bad_shapes():
    ops = vnni.ops()
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.int8_linear(torch.zeros(1, 96, dtype=torch.bfloat16), torch.zeros(4, 96, dtype=torch.uint8),
                        torch.ones(4), None)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        ops.int8_linear(torch.zeros(1, 64), torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4), None)


@pytest.mark.parametrize("fmt,kind,same", [("int4", int4.Int4Linear, 4), ("int8", int8.Int8Linear, 12)])
def test_quantized_model_close_to_bf16(tmp_path, fmt, kind, same):
    path = str(save_hf_dir(tiny_hf_model("qwen2", logit_scale=5), tmp_path))
    cfg = EngineConfig(device="cpu", dtype="bfloat16", max_context=128)
    dense = load_model(path, cfg, progress=False)
    quant = load_model(path, EngineConfig(**{**cfg.__dict__, "weights": fmt}), progress=False)
    assert isinstance(quant.model.layers[0].attention.wqkv, kind) and isinstance(quant.model.output, kind)
    params = SamplingParams(max_tokens=24, stop_at_eos=False)
    prompt = [3, 14, 15, 92, 65]
    dense_tokens = [e.token for e in Engine(dense, 128).generate(prompt, params) if e.token is not None]
    quant_tokens = [e.token for e in Engine(quant, 128).generate(prompt, params) if e.token is not None]
    assert dense_tokens[:same] == quant_tokens[:same]  # the same argmax at first (longer for 8 bits)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantized_formats_need_bf16(tmp_path, fmt):
    path = str(save_hf_dir(tiny_hf_model("qwen2"), tmp_path))
    with pytest.raises(QuickdraftError, match=f"{fmt} runs with bfloat16 activations"):
        load_model(path, EngineConfig(device="cpu", dtype="float32", weights=fmt), progress=False)
    with pytest.raises(QuickdraftError, match="choose auto, bf16, int8, int4"):
        load_model(path, EngineConfig(device="cpu", weights="int3"), progress=False)


def test_pass_bytes_count_the_runtime_format(tmp_path):
    from quickdraft.tools.roofline import pass_bytes

    path = str(save_hf_dir(tiny_hf_model("qwen2", vocab=512, layers=2), tmp_path))
    sizes = {}
    for fmt in ("bf16", "int8", "int4"):
        lm = load_model(path, EngineConfig(device="cpu", dtype="bfloat16", weights=fmt), progress=False)
        sizes[fmt] = pass_bytes(lm.model, context=0)
        if fmt == "bf16":  # every weight at 2 bytes but the embedding table, of which one row is read
            m = lm.model
            weights = sum(p.numel() for n, p in m.named_parameters() if n != "tok_embeddings.weight")
            rotary = 2 * 4 * m.cfg.head_dim  # one row of the float32 cos and sin tables
            assert sizes[fmt] == 2 * (weights + m.cfg.dim) + rotary
    assert sizes["int4"] < 0.7 * sizes["int8"] < 0.6 * sizes["bf16"]  # scales and norms weigh on tiny layers


@pytest.mark.parametrize("module", [int4, int8])
def test_quantizing_in_row_chunks_changes_nothing(monkeypatch, backend, module):
    torch.manual_seed(2)
    w = torch.randn(208, 128)  # 3 whole blocks of 64 rows and a tail of 16
    kind = module.Int4Linear if module is int4 else module.Int8Linear
    whole = kind(w, None)
    monkeypatch.setattr(module, "ROWS", 64)  # four chunks (the int4 packing works in blocks of 64 rows)
    chunked = kind(w, None)
    assert all(torch.equal(a, b) for a, b in zip(whole.buffers(), chunked.buffers()))


def test_fit_recovers_a_4bit_grid_min_max_misses(backend):
    """Blocks dequantized from a 4-bit file lie on a grid; where their codes do not span 0..15, min-max
    picks another grid, and the least-squares refits find the file's own."""
    torch.manual_seed(3)
    codes = torch.randint(1, 14, (64, 4, int4.GROUP)).float()
    codes[..., 0], codes[..., 1] = 1, 13  # span 1..13 in every group
    w = codes * 0.003 - 0.02
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    min_max = int4._sq_error(w, (hi - lo) / 15, lo).sum()
    scale, low = int4.fit(w)
    assert int4._sq_error(w, scale, low).sum() < 1e-3 * min_max
    torch.testing.assert_close(scale, torch.full_like(scale, 0.003))


@pytest.mark.skipif(not vnni.available(), reason="no VNNI kernel on this CPU")
@pytest.mark.parametrize("start,rows,window,batch,d", [
    (0, 1, 0, 1, 32), (20, 1, 0, 1, 32), (37, 5, 0, 1, 32), (3, 17, 0, 1, 32), (37, 5, 8, 1, 32), (3, 17, 4, 1, 32),
    (150, 5, 0, 2, 32), (150, 3, 70, 1, 32), (37, 5, 0, 1, 128), (120, 64, 0, 1, 128), (100, 33, 50, 1, 128),
    (61, 13, 9, 2, 64), (90, 7, 0, 1, 256), (45, 6, 0, 1, 80)])
def test_decode_attention_matches_sdpa_row_by_row(start, rows, window, batch, d):
    """The CPU attention kernel against PyTorch's attention (in float32) row by row, over a cache view
    with room to spare (as the KV cache hands it), and each row equal to a one-row call: batch invariant, whichever
    heads and rows share a tile of keys or a register block of scores or weighted values (several tiles; rows whose
    spans differ by their position or window; head sizes whose value rows take one, two or a partial block of
    chunks; two sequences; 1 or 2 threads). With a window, each row sees its last `window` positions (a
    sliding-window layer)."""
    import torch.nn.functional as F

    torch.manual_seed(start + rows)
    cache_k = torch.randn(batch, 2, 256, d, dtype=torch.bfloat16)
    cache_v = torch.randn(batch, 2, 256, d, dtype=torch.bfloat16)
    keys, values = cache_k[:, :, :start + rows], cache_v[:, :, :start + rows]
    q = torch.randn(batch, 6, rows, d, dtype=torch.bfloat16) * 3
    got = vnni.ops().decode_attention(q, keys, values, start, window)
    for i in range(rows):
        seen = slice(max(0, start + i + 1 - window) if window else 0, start + i + 1)
        want = F.scaled_dot_product_attention(q[:, :, i:i + 1].float(), keys[:, :, seen].float(),
                                              values[:, :, seen].float(), enable_gqa=True)
        torch.testing.assert_close(got[:, :, i:i + 1].float(), want, rtol=1e-2, atol=1e-2)
        alone = vnni.ops().decode_attention(q[:, :, i:i + 1].contiguous(), keys[:, :, :start + i + 1],
                                                           values[:, :, :start + i + 1], start + i, window)
        assert torch.equal(alone, got[:, :, i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the pairs split among threads otherwise
        assert torch.equal(vnni.ops().decode_attention(q, keys, values, start, window), got)
    finally:
        torch.set_num_threads(threads)


def every_op_once():
    """(op name, arguments) covering each op of the kernels and their shapes' edge cases: 1-13 rows and a row of
    massive activations (two levels of codes), K blocks and a group count that is not a multiple of 16, output widths
    with a tail, attention over several tiles, windows, grouped heads and head sizes 16-256, the fused steps' widths."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    out = []
    for rows in (1, 2, 4, 5, 6, 9, 13):  # levels (a massive row has two): 1, 3, 5-7, 8 + 2, 8 + 6
        for n, k in ((40, 2304), (36, 1408), (1540, 896)):
            x = r(rows, k, scale=3).bfloat16()
            x[0, :5] = 0
            if rows > 1:
                x[-1, 7] = 3000
            bias = r(n).bfloat16() if rows % 2 else None
            u = torch.randint(1, 256, (n, k), dtype=torch.uint8, generator=g)
            out.append(("int8_linear", (x, vnni.tile(u, 64), torch.rand(n, generator=g) * 0.01, bias)))
            if k % 128 == 0:
                codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
                s, lo = (torch.rand(n, k // 32, generator=g) * 0.01).half(), r(n, k // 32, scale=0.05).half()
                out.append(("int4_linear", (x, vnni.tile(vnni.pack_int4(codes), 64), vnni.tile(s, 4), lo, bias)))
    for start, rows, window, batch, d, h, hkv in [(0, 1, 0, 1, 32, 6, 2), (37, 5, 0, 1, 128, 12, 2),
                                                  (3, 17, 4, 1, 64, 4, 1), (150, 5, 0, 2, 64, 8, 2),
                                                  (150, 3, 70, 1, 256, 4, 1), (77, 1, 0, 1, 16, 2, 2),
                                                  (120, 64, 40, 1, 128, 12, 2), (45, 6, 0, 1, 80, 6, 3)]:
        keys, values = (r(batch, hkv, start + rows + 11, d).bfloat16() for _ in range(2))
        q = r(batch, h, rows, d, scale=3).bfloat16()
        out.append(("decode_attention", (q, keys[:, :, :start + rows], values[:, :, :start + rows], start, window)))
    for width in (16, 48, 896):
        out.append(("rms_norm", (r(3, width, scale=3).bfloat16(), r(width).bfloat16(), 1e-6)))
        out.append(("silu_mul", (r(3, 2 * width, scale=6).bfloat16(),)))
    for hq, hkv, d, rows in ((4, 2, 64, 3), (12, 2, 128, 5)):
        out.append(("qkv_rotary", (r(2, rows, (hq + 2 * hkv) * d).bfloat16(), r(rows, d), r(rows, d), hq, hkv)))
    state = r(2, 3, 16, 24)
    out.append(("gated_delta_step", (state, r(2, 3, 16), r(2, 3, 16), r(2, 3, 24), torch.rand(2, 3, generator=g),
                                     torch.rand(2, 3, generator=g), torch.empty_like(state))))
    out.append(("int4_fit", (r(500, 32, scale=0.02), 3)))
    return out


@pytest.mark.skipif(any(b.reason() for b in vnni.BUILDS.values()), reason="this CPU runs one of the two builds only")
def test_the_avx2_build_gives_the_avx512_builds_bits():
    """The kernels built for AVX2 and for AVX-512 VNNI, op by op on the same inputs: the same bits (so a model's output
    does not depend on the build), and the AVX2 build's fused layer step is its modules' too (below, per build)."""
    builds = [getattr(torch.ops, b.prefix) for b in vnni.BUILDS.values()]
    for name, args in every_op_once():
        got = []
        for ops in builds:
            fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # gated_delta_step writes
            res = getattr(ops, name)(*fresh)
            got.append((*(res if isinstance(res, tuple) else (res,)), fresh[-1]))
        assert all(torch.equal(a, b) for a, b in zip(*got) if isinstance(a, torch.Tensor)), name


@pytest.mark.skipif(not vnni.available(), reason="no VNNI kernel on this CPU")
def test_fused_steps_equal_the_pytorch_code_bit_for_bit():
    """RMSNorm, SiLU-and-multiply and the q/k rotary as one call each: exactly the model's PyTorch code."""
    import torch.nn.functional as F

    from quickdraft.models import rope, transformer as T

    torch.manual_seed(4)
    ops = vnni.ops()
    norm = T.RMSNorm(256, 1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(256, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16) * 3
    h = x.float()
    assert torch.equal(norm(x), norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype))
    gate_up = torch.randn(3, 2 * 96, dtype=torch.bfloat16) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate) * up)
    cos, sin = (t[5:8] for t in rope.tables(RopeConfig(theta=1e6), 64, 16))
    qkv = torch.randn(1, 3, 8 * 64, dtype=torch.bfloat16)
    q, k, v = (t.reshape(1, 3, -1, 64).transpose(1, 2) for t in qkv.split((256, 128, 128), dim=-1))
    got = ops.qkv_rotary(qkv, cos.contiguous(), sin.contiguous(), 4, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, (T.apply_rotary(q, cos, sin), T.apply_rotary(k, cos, sin), v)))



@pytest.mark.skipif(not vnni.available(), reason="no VNNI kernel on this CPU")
@pytest.mark.parametrize("kind", [int4.Int4Linear, int8.Int8Linear])
def test_a_row_of_massive_activations_keeps_its_small_channels(kind):
    """One channel at 3000 and the rest near 1, as LLMs make of their first token: with one scale per row
    the rest would round to 0 or +-1; the second level keeps the output as close as an ordinary row's."""
    torch.manual_seed(5)
    layer = kind(torch.randn(64, 512) * 0.05, None)
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    x[1, 100] = 3000
    w = layer.dequantized()
    want = x.float() @ w.t()
    err = ((layer(x).float() - want).abs().amax(-1) / want.abs().amax(-1))
    assert err[1] < 0.02 and err[1] < 3 * err[0] + 0.005
    torch.testing.assert_close(layer(x).float(), layer.reference(x).float(), rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_embedding_rows_are_their_codes(monkeypatch, backend, fmt):
    torch.manual_seed(0)
    w = torch.randn(300, 256)
    w[5, 17] = 40.0  # an outlier costs only its own group precision
    table = embedding.table(fmt, w)
    assert isinstance(table, embedding.QuantEmbedding)
    ids = torch.tensor([[0, 299, 5], [7, 150, 3]])
    got = table(ids)
    assert got.shape == (2, 3, 256) and got.dtype == torch.bfloat16
    groups = w.reshape(300, -1, 32)
    if fmt == "int8":
        s = (groups.abs().amax(-1) / 127).to(torch.float16).float()
        ref = ((groups / s[..., None]).round().clamp(-127, 127) * s[..., None]).reshape(300, -1)
        step = s
    else:
        q, s, lo = int4.quantize(w, torch.float16)
        ref = (q.float().reshape(300, -1, 32) * s.float()[..., None] + lo.float()[..., None]).reshape(300, -1)
    assert torch.equal(got, ref[ids].to(torch.bfloat16))  # exactly what the codes stand for
    if fmt == "int8":  # half a step of its group
        assert ((ref - w).abs() <= 0.51 * step.repeat_interleave(32, -1) + 1e-6).all()
    else:  # each group no worse than min-max rounding (the fit trades the extremes for the rest)
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        min_max = int4._sq_error(groups, (hi - lo) / 15, lo)[..., 0]
        assert (((ref - w) ** 2).reshape(300, -1, 32).sum(-1) <= 1.02 * min_max + 1e-4).all()
    assert table.row_bytes() < (0.55 if fmt == "int8" else 0.35) * 256 * 2  # against a bf16 row
    monkeypatch.setattr(embedding, "ROWS", 64)  # quantized in blocks of rows: the same codes
    chunked = embedding.table(fmt, w)
    assert all(torch.equal(a, b) for a, b in zip(table.buffers(), chunked.buffers()))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_gguf_block_table_stays_in_its_blocks_and_looks_up_exactly(tmp_path, monkeypatch, fmt):
    """An embedding table the file holds in a block format is kept as those blocks: its lookups are the
    rows a bf16 load gives, bit for bit, in the file's size."""
    from gguf import GGMLQuantizationType as T

    import transformers

    torch.manual_seed(0)
    cfg = tiny_hf_config("qwen2", vocab=320)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = str(write_gguf_from_hf(hf, tmp_path / "m.gguf", table_type=T.Q8_0))
    monkeypatch.setattr(embedding, "ROWS", 100)  # copied out of the file in blocks of rows
    small = load_model(path, EngineConfig(device="cpu", dtype="bfloat16", weights=fmt), progress=False).model
    dense = load_model(path, EngineConfig(device="cpu", dtype="bfloat16", weights="bf16"), progress=False).model
    table = small.tok_embeddings
    assert isinstance(table, embedding.BlockEmbedding) and table.qtype == T.Q8_0
    ids = torch.tensor([[0, 319, 5, 5, 101]])
    assert torch.equal(table(ids), dense.tok_embeddings(ids))
    assert torch.equal(table(torch.arange(320)), dense.tok_embeddings.weight)
    assert table.row_bytes() == 64 // 32 * 34  # two Q8_0 blocks of 32 (34 bytes each) a row


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tie", [False, True])
def test_gguf_tables_read_by_rows_equal_the_whole_tensors(tmp_path, monkeypatch, fmt, tie):
    """A GGUF file's vocabulary tables reach the quantizer a block of rows at a time (never whole in bf16);
    the model is the one the same weights make from a Hugging Face directory, read whole."""
    import transformers

    torch.manual_seed(0)
    cfg = tiny_hf_config("qwen2", vocab=320)
    cfg.hidden_size, cfg.num_attention_heads, cfg.tie_word_embeddings = 128, 4, tie  # int4 tables: width % 128
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    engine = EngineConfig(device="cpu", dtype="bfloat16", weights=fmt)
    blocks = []
    read_rows = gguf_io.FileRows.__getitem__
    monkeypatch.setattr(gguf_io.FileRows, "__getitem__", lambda self, s: blocks.append(s) or read_rows(self, s))
    monkeypatch.setattr(embedding, "ROWS", 128)
    from_gguf = load_model(str(write_gguf_from_hf(hf, tmp_path / "m.gguf")), engine, progress=False).model
    from_hf = load_model(str(save_hf_dir(hf, tmp_path / "hf")), engine, progress=False).model
    assert isinstance(from_gguf.tok_embeddings, embedding.QuantEmbedding)
    assert slice(256, 384) in blocks  # the table was read by blocks of rows
    assert isinstance(from_gguf.output, int4.Int4Linear if fmt == "int4" else int8.Int8Linear)  # tied or not
    a, b = from_gguf.state_dict(), from_hf.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(not vnni.available(), reason="no VNNI kernel on this CPU")
@pytest.mark.parametrize("qkv_bias", [True, False])
def test_fused_layer_step_equals_the_modules_bit_for_bit(monkeypatch, qkv_bias):
    """block_step (one C++ call a layer) against the same layer run module by module: a prefill, one-token
    steps and verification passes give identical logits and identical KV caches, int4 and int8 layers mixed."""
    from quickdraft.config import ModelConfig
    from quickdraft.models import transformer as T
    from quickdraft.runtime.kv_cache import KVCache

    torch.manual_seed(5)
    cfg = ModelConfig(arch="qwen2", vocab_size=256, dim=256, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=64,
                      ffn_dim=384, norm_eps=1e-6, rope_theta=1e6, max_context=128, qkv_bias=qkv_bias)
    model = T.Transformer(cfg).to(torch.bfloat16)
    for p in model.parameters():
        p.data = torch.randn_like(p) * (0.05 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0)
    model.set_rotary(cfg.max_context)  # float32, as the loader keeps them
    for i, block in enumerate(model.layers):  # layer 0 all int4, 1 all int8, 2 mixed
        for j, (parent, attr) in enumerate([(block.attention, "wqkv"), (block.attention, "wo"),
                                            (block.feed_forward, "w13"), (block.feed_forward, "w2")]):
            old = getattr(parent, attr)
            kind = [int4.Int4Linear, int8.Int8Linear][(i + j * (i == 2)) % 2]
            setattr(parent, attr, kind(old.weight.data, None if old.bias is None else old.bias.data))
    from quickdraft.runtime.plan import plan

    assert plan(model)["fused_layers"] == 3

    def run(fused):
        plan(model, fused_layers=fused)
        cache = KVCache.for_model(model, 128)
        outs = [model(torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1)), cache)]
        for s in (1, 1, 5, 8, 1):
            outs.append(model(torch.arange(s).reshape(1, s) * 7 % 256, cache))
        cache.rollback(74)  # a rejected draft's positions are written over
        outs.append(model(torch.tensor([[9, 8, 7]]), cache))
        return outs, torch.stack([k[:, :, :cache.length] for k in cache.k]), torch.stack([v[:, :, :cache.length]
                                                                                       for v in cache.v])

    with torch.inference_mode():
        (ref, ref_k, ref_v), (got, got_k, got_v) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert torch.equal(ref_k, got_k) and torch.equal(ref_v, got_v)
    # the fused step really ran: swapping a layer for a float one drops that block back to its modules
    block = model.layers[0]
    block.feed_forward.w2 = T.Linear(384, 256, bias=False).to(torch.bfloat16)
    plan(model)
    assert block.step is None and model.layers[1].step is not None


def test_mixed_follows_the_file_int4_where_it_holds_4_bits(tmp_path, monkeypatch, backend):
    """`mixed`: a module whose every part the file holds in 4-bit blocks is int4 (and holds their values almost
    exactly, far closer than int8 does); a module with any part in more bits is int8; a float checkpoint is
    int8 throughout."""
    from gguf import GGMLQuantizationType as T

    from quickdraft.quant.blocks import dequantize

    import transformers

    config = tiny_hf_config("qwen2")
    config.hidden_size, config.intermediate_size = 128, 256  # rows of 128: int4 on quickdraft's kernel
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    four, eight = T.Q4_0, T.Q8_0
    types = {"attn_q.weight": four, "attn_k.weight": four, "attn_v.weight": eight, "attn_output.weight": four,
             "ffn_gate.weight": four, "ffn_up.weight": four, "ffn_down.weight": eight}
    path = str(write_gguf_from_hf(hf, tmp_path / "m.gguf", layer_types=types))
    cfg = EngineConfig(device="cpu", dtype="bfloat16", max_context=128)
    mixed = load_model(path, EngineConfig(**{**cfg.__dict__, "weights": "mixed"}), progress=False)
    layer = mixed.model.layers[1]
    kinds = {name: type(m) for name, m in [("wqkv", layer.attention.wqkv), ("wo", layer.attention.wo),
                                            ("w13", layer.feed_forward.w13), ("w2", layer.feed_forward.w2)]}
    assert kinds == {"wqkv": int8.Int8Linear, "wo": int4.Int4Linear, "w13": int4.Int4Linear, "w2": int8.Int8Linear}
    assert isinstance(mixed.model.output, int8.Int8Linear)  # the head is F32 in the file
    assert mixed.weights == "mixed"

    reader = gguf_io.open_gguf(path)
    raw = next(t for t in reader.tensors if t.name == "blk.1.attn_output.weight")
    exact = dequantize(raw.data, raw.tensor_type, tuple(int(n) for n in reversed(raw.shape)), torch.float32)
    as_int8 = load_model(path, EngineConfig(**{**cfg.__dict__, "weights": "int8"}), progress=False)
    err4 = (layer.attention.wo.dequantized(_codes_of(layer.attention.wo, exact)) - exact).pow(2).mean().sqrt()
    err8 = (as_int8.model.layers[1].attention.wo.dequantized() - exact).pow(2).mean().sqrt()
    bf16 = (exact.to(torch.bfloat16).float() - exact).pow(2).mean().sqrt()  # what a bf16 load is off by
    if layer.attention.wo.vnni:  # float16 grids (PyTorch's op takes bfloat16 ones, which round the grid)
        assert err4 < 0.3 * err8 and err4 < bf16, (err4, err8, bf16)  # closer to the file than a bf16 load

    hf_dir = load_model(str(save_hf_dir(hf, tmp_path / "hf")), EngineConfig(**{**cfg.__dict__, "weights": "mixed"}),
                        progress=False)
    assert all(isinstance(m, int8.Int8Linear) for m in hf_dir.model.modules() if isinstance(m, (int4.Int4Linear,
                                                                                                 int8.Int8Linear)))


def _codes_of(layer, weight):
    """The codes of weight on layer's grids, for `dequantized` on PyTorch's opaque int4 packing."""
    if layer.vnni:
        return None
    q, _, _ = int4.quantize(weight)
    return q


needs_avx2 = pytest.mark.skipif(not avx2.available(), reason=f"no AVX2 kernel here: {avx2.unavailable_reason()}")


@needs_avx2
@pytest.mark.parametrize("shape", [(96, 64), (37, 61), (5, 7)], ids=["even", "ragged", "tiny"])
def test_the_float32_linear_sums_each_output_in_one_order(shape):
    """linear_f32 against float64, and each row bit for bit the same alone, among 2 or 40 rows, on 1 to 4 threads
    (PyTorch's float32 GEMM fails the second: MKL orders a row's sums by the row and thread counts)."""
    n, k = shape
    torch.manual_seed(0)
    w, x, b = torch.randn(n, k), torch.randn(40, k), torch.randn(n)
    full = torch.ops.quickdraft_avx2.linear_f32(x, w, b)
    assert torch.allclose(full, avx2.linear_reference(x, w, b), atol=1e-4, rtol=1e-5)
    assert torch.ops.quickdraft_avx2.linear_f32(x, w, None).shape == (40, n)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            for rows in (1, 2, 7, 40):
                assert torch.equal(torch.ops.quickdraft_avx2.linear_f32(x[:rows], w, b), full[:rows]), (threads, rows)
    finally:
        torch.set_num_threads(before)


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", list(avx2.ACTIVATIONS))
def test_the_activation_kernel_gives_each_element_one_result(dtype, activation):
    """act_mul against PyTorch's ops (to the last bits of exp), and each row the same alone or among 50, whatever the
    threads (ragged widths: tails through the vector code)."""
    torch.manual_seed(0)
    gate_up = (3 * torch.randn(50, 2 * 1027)).to(dtype)
    full = torch.ops.quickdraft_avx2.act_mul(gate_up, avx2.ACTIVATIONS[activation])
    want = avx2.act_mul_reference(gate_up, activation)
    assert torch.allclose(full.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 0.02, rtol=0.01)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3, 4):
            torch.set_num_threads(threads)
            for rows in (1, 3, 50):
                got = torch.ops.quickdraft_avx2.act_mul(gate_up[:rows], avx2.ACTIVATIONS[activation])
                assert torch.equal(got, full[:rows]), (threads, rows)
    finally:
        torch.set_num_threads(before)
