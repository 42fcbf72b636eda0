"""The CPU kernels against torch's own operators, on the shapes the decoder gives them and on ragged ones."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from node.engine import cpu_kernels
from node.engine.cpu_kernels import LIBRARY_SCREEN_ROWS, CpuKernels, load_kernels
from node.engine.kernel_operands import PackedHead, RowsAt, decode_work_floats

TOLERANCE = 1e-5
"""Float32 sums taken in another order: relative to the largest |value| of the reference."""


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return float((got - expected).abs().max()) <= TOLERANCE * max(1.0, float(expected.abs().max()))


def test_switched_off_means_no_kernels_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENZRO_NATIVE", "off")
    found = load_kernels()
    assert found.kernels is None and found.reason == "switched off by TENZRO_NATIVE=off"


def test_a_cpu_without_avx512_gets_no_kernels_and_says_what_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENZRO_NATIVE", raising=False)
    avx2_only = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2".split()
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset(avx2_only))
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    found = load_kernels()
    assert found.kernels is None
    assert found.reason == "this CPU has no AVX-512 (AVX2; missing avx512f, avx512bw, avx512cd, avx512dq, avx512vl)"


def test_an_install_that_built_no_library_means_no_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TENZRO_NATIVE", raising=False)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset(cpu_kernels.REQUIRED_FLAGS))
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernels, "library_path", lambda: None)
    assert "not built when the node was installed" in load_kernels().reason
    broken = tmp_path / "_cpu_kernels.so"
    broken.write_bytes(b"not a shared library")
    found = load_kernels(broken)
    assert found.kernels is None and found.reason.startswith("the native kernels do not load")


def test_another_architecture_gets_no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENZRO_NATIVE", raising=False)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    assert load_kernels().reason == "the native kernels are x86-64 code; this CPU is aarch64"


def test_the_installed_library_is_the_one_loaded(kernels: CpuKernels) -> None:
    path = cpu_kernels.library_path()
    assert path is not None and path.parent == Path(cpu_kernels.__file__).parent
    assert load_kernels().reason == f"AVX-512 kernels from {path.name}"


@pytest.mark.parametrize(("rows", "inputs", "outputs"), [(32, 512, 1536), (1, 64, 32000), (13, 100, 45),
                                                         (64, 48, 16), (65, 32, 33), (7, 1, 1), (20, 37, 70)])
def test_gemm_matches_matmul(kernels: CpuKernels, rows: int, inputs: int, outputs: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + outputs)
    weight = torch.randn(outputs, inputs, generator=generator)
    bias = torch.randn(outputs, generator=generator)
    x = torch.randn(rows, inputs, generator=generator)
    packed = kernels.pack(weight, bias)
    out = torch.full((rows, outputs), float("nan"))
    kernels.gemm(x, packed, out)
    assert close(out, x @ weight.T + bias)
    base = torch.randn(rows, outputs, generator=generator)
    accumulated = base.clone()
    kernels.gemm(x, packed, accumulated, accumulate=True)
    assert close(accumulated, base + x @ weight.T + bias)


def adversarial_head(generator: torch.Generator, rows: int, inputs: int) -> torch.Tensor:
    """Random rows, plus rows the int8 screen cannot tell apart: an exact copy of another row (a tie) and a
    copy that differs from another only in the low 16 bits of each weight."""
    weight = torch.randn(rows, inputs, generator=generator) * 0.05
    weight[rows // 2] = weight[3]  # a tie: the first of the two must win
    nudged = weight[7].clone().view(torch.int32)
    nudged ^= torch.randint(0, 1 << 16, (inputs,), generator=generator, dtype=torch.int32)
    weight[rows - 1] = nudged.view(torch.float32)
    return weight


SCREENS = ["hand-written", "library"]
"""`head_argmax`'s two screens: int8 codes of the head times float32 x (`tz_head_argmax`), and the library's int8
product of codes of both (`torch._int_mm`, then `tz_head_pick`) from LIBRARY_SCREEN_ROWS rows."""


def screened(kernels: CpuKernels, x: torch.Tensor, head: PackedHead, screen: str) -> list[int | None]:
    """`head_argmax` of x's rows through `screen`: the library's with x's last row repeated up to
    LIBRARY_SCREEN_ROWS rows where x has fewer."""
    if screen == "hand-written":
        return kernels.head_argmax(x, replace(head, rows=None))
    if head.rows is None:
        pytest.skip("this CPU has no exact library int8 product (no VNNI or AMX): the hand-written screen serves")
    short = LIBRARY_SCREEN_ROWS - x.shape[0]
    padded = torch.cat([x, x[-1:].expand(short, -1)]) if short > 0 else x
    return kernels.head_argmax(padded, head)[:x.shape[0]]


def head_logits(kernels: CpuKernels, x: torch.Tensor, head: PackedHead) -> torch.Tensor:
    logits = torch.empty(1, head.out_features)
    kernels.gemm(x.unsqueeze(0), head.weight, logits)
    return logits[0]


@pytest.mark.parametrize("screen", SCREENS)
@pytest.mark.parametrize(("rows", "inputs", "with_bias"), [(1000, 64, False), (333, 95, True), (4100, 512, False),
                                                           (700, 37, False)])
def test_head_argmax_is_the_argmax_of_the_float32_logits(kernels: CpuKernels, rows: int, inputs: int,
                                                         with_bias: bool, screen: str) -> None:
    """The int8 screen picks exactly the token of the full float32 logits, ties and rows that only the low
    bits tell apart included, and decides by itself (no fallback) on ordinary inputs."""
    generator = torch.Generator().manual_seed(rows + inputs)
    weight = adversarial_head(generator, rows, inputs)
    bias = torch.randn(rows, generator=generator) * 0.1 if with_bias else None
    head = kernels.pack_head(weight.t().contiguous().t(), bias)  # a transposed view, as the loader holds it
    for trial in range(300):
        x = torch.randn(inputs, generator=generator) * (1 + trial % 7)
        if trial % 3 == 0:
            x = weight[[3, 7, rows - 1][trial % 9 // 3]].clone() * 20  # aimed at the tied and nudged rows
        logits = head_logits(kernels, x, head)
        assert close(logits, weight @ x + (bias if bias is not None else 0))
        assert screened(kernels, x.unsqueeze(0), head, screen) == [int(torch.argmax(logits))], trial


@pytest.mark.parametrize("screen", SCREENS)
def test_head_argmax_finds_a_row_the_screen_ranks_below_another(kernels: CpuKernels, screen: str) -> None:
    """Rows built so that int8 rounding reverses their order: row 1 screens 0.01 above row 2 but is 0.009
    below it in float32. Only a bound that covers the rounding keeps row 2 a candidate."""
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(100, 8, generator=generator) * 0.001  # rows far below the two
    step = 0.01
    for row, (second, third) in ((1, (5 - 0.45, 3 + 0.51)), (2, (5 + 0.45, 3 + 0.49))):
        weight[row] = torch.tensor([127.0, second, third, 0, 0, 0, 0, 0]) * step  # same scale: max is 1.27
    head = kernels.pack_head(weight)
    x = torch.tensor([0.0, 1.0, 1.0, 0, 0, 0, 0, 0])
    logits = head_logits(kernels, x, head)
    assert int(torch.argmax(logits)) == 2
    assert screened(kernels, x.unsqueeze(0), head, screen) == [2]


@pytest.mark.parametrize("screen", SCREENS)
def test_head_argmax_leaves_undecidable_inputs_to_the_caller(kernels: CpuKernels, screen: str) -> None:
    generator = torch.Generator().manual_seed(2)
    head = kernels.pack_head(torch.randn(500, 64, generator=generator))
    zeros = torch.zeros(1, 64)
    assert screened(kernels, zeros, head, screen) == [None]  # every logit ties: more candidates than allowed
    x = torch.randn(64, generator=generator)
    x[5] = float("nan")
    assert screened(kernels, x.unsqueeze(0), head, screen) == [None]
    x[5] = float("inf")
    assert screened(kernels, x.unsqueeze(0), head, screen) == [None]


def test_gemm_reads_strided_rows_and_transposed_weights(kernels: CpuKernels) -> None:
    generator = torch.Generator().manual_seed(1)
    weight_t = torch.randn(40, 70, generator=generator)  # [in, out], as TransposedLinear holds it
    wide = torch.randn(19, 100, generator=generator)
    x = wide[:, 10:50]  # rows 100 floats apart
    out = torch.zeros(19, 90)[:, 5:75]
    kernels.gemm(x, kernels.pack(weight_t.t()), out)
    assert close(out, x @ weight_t)


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim", "start"),
                         [(32, 8, 8, 64, 992), (16, 4, 2, 32, 0), (17, 4, 1, 32, 53), (64, 2, 2, 128, 236),
                          (40, 6, 3, 64, 1), (33, 4, 2, 32, 100), (1, 4, 4, 64, 500), (63, 2, 1, 32, 7),
                          (64, 2, 2, 64, 0)])
def test_attention_matches_sdpa(kernels: CpuKernels, tokens: int, heads: int, kv_heads: int, head_dim: int,
                                start: int) -> None:
    generator = torch.Generator().manual_seed(tokens + start)
    length, capacity = start + tokens, start + tokens + 9
    # Keys and values as the working cache holds them: views of longer buffers.
    key_buffer = torch.randn(1, kv_heads, capacity, head_dim, generator=generator)
    value_buffer = torch.randn(1, kv_heads, capacity, head_dim, generator=generator)
    keys, values = key_buffer[:, :, :length], value_buffer[:, :, :length]
    q = torch.randn(tokens, heads, head_dim, generator=generator) * 3
    out = torch.full((tokens, heads * head_dim), float("nan"))
    assert kernels.attention(q, [(keys, values)], start, 1 / math.sqrt(head_dim), out)
    mask = torch.ones(tokens, length, dtype=torch.bool).tril(start)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask,
                                              enable_gqa=heads != kv_heads)
    assert close(out, expected[0].transpose(0, 1).reshape(tokens, -1))


def test_attention_rescales_when_later_keys_score_higher(kernels: CpuKernels) -> None:
    """Keys whose scores grow with position: the running maximum rises in every block of the online softmax,
    so each block rescales what the earlier ones summed."""
    generator = torch.Generator().manual_seed(5)
    tokens, heads, head_dim, length = 20, 2, 64, 400
    q = torch.randn(tokens, heads, head_dim, generator=generator).abs()
    growth = torch.linspace(0.0, 3.0, length).view(1, 1, length, 1)
    keys = torch.rand(1, heads, length, head_dim, generator=generator) * growth
    values = torch.randn(1, heads, length, head_dim, generator=generator)
    out = torch.empty(tokens, heads * head_dim)
    assert kernels.attention(q, [(keys, values)], length - tokens, 0.125, out)
    mask = torch.ones(tokens, length, dtype=torch.bool).tril(length - tokens)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask, scale=0.125)
    assert close(out, expected[0].transpose(0, 1).reshape(tokens, -1))


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(4, 2, 16), (8, 8, 64), (8, 2, 32), (4, 1, 128), (22, 2, 64), (11, 1, 32), (9, 1, 128),
                          (32, 2, 64), (32, 1, 64)])
def test_decode_attention_matches_sdpa_row_by_row(kernels: CpuKernels, heads: int, kv_heads: int,
                                                  head_dim: int) -> None:
    """Five rows, each one query over its own history (1 to 700 keys, views of longer buffers as lanes hold
    them): the outputs SDPA gives each row alone, and each head's log-sum-exp of its scaled scores. 16 and 32
    queries per key/value head are a shared-rows group's, which take all their scores in one pass."""
    generator = torch.Generator().manual_seed(heads * head_dim + kv_heads)
    lengths = [1, 5, 64, 333, 700]
    history = [(torch.randn(1, kv_heads, n + 11, head_dim, generator=generator)[:, :, :n],
                torch.randn(1, kv_heads, n + 11, head_dim, generator=generator)[:, :, :n]) for n in lengths]
    q = torch.randn(len(lengths), heads, head_dim, generator=generator) * 3
    out = torch.full_like(q, float("nan"))
    lse = torch.full((len(lengths), heads), float("nan"))
    work = torch.zeros(decode_work_floats(heads, kv_heads, head_dim, max(lengths)))
    assert kernels.decode_attention(q, history, 0.2, out, lse, work)
    for row, (keys, values) in enumerate(history):
        query = q[row].view(1, heads, 1, head_dim)
        expected = F.scaled_dot_product_attention(query, keys, values, scale=0.2, enable_gqa=heads != kv_heads)
        assert close(out[row], expected[0, :, 0])
        scores = torch.einsum("hd,hnd->hn", query[0, :, 0], keys[0].repeat_interleave(heads // kv_heads, 0)) * 0.2
        assert torch.allclose(lse[row], torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)


def buffers_at(buffers: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int]) -> RowsAt:
    return RowsAt([k.data_ptr() for k, _ in buffers], [v.data_ptr() for _, v in buffers],
                  [k.stride(1) for k, _ in buffers], lengths, buffers[0][0].shape[1])


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "sizes"),
                         [(8, 8, 64, (5, 12, 32)), (8, 2, 64, (9, 2)), (6, 2, 32, (4,)), (71, 1, 64, (3,)),
                          (4, 4, 128, (17,)), (12, 4, 64, (11,))])
def test_a_groups_shared_rows_are_read_once_for_all_its_members(kernels: CpuKernels, heads: int, kv_heads: int,
                                                                head_dim: int, sizes: tuple[int, ...]) -> None:
    """Groups of rows whose buffers begin with the same rows (5, 12 and 32 members: a few queries per pass, all
    of 16 and of 32 in one pass; 9 members of 4 queries each: chunks of 32 queries; 11 of 3: chunks of 30, padded
    to 32), and rows alone: each row's output and log-sum-exp are those of its whole history attended alone."""
    generator = torch.Generator().manual_seed(heads + sum(sizes))
    capacity = 500  # the longest history: 300 + 32 shared rows and 150 own
    buffers, lengths, groups, row = [], [], [], 0
    for size in (*sizes, 3):  # the last three rows alone
        shared = torch.randn(2, 1, kv_heads, 300 + size, head_dim, generator=generator)
        members = []
        for _ in range(size):
            own = 1 + int(torch.randint(0, 150, (1,), generator=generator))
            keys, values = torch.randn(2, 1, kv_heads, capacity, head_dim, generator=generator)
            keys[:, :, :shared.shape[3]], values[:, :, :shared.shape[3]] = shared[0], shared[1]
            buffers.append((keys, values))
            lengths.append(shared.shape[3] + own)
            members.append(row)
            row += 1
        if size != 3 or len(groups) < len(sizes):
            groups.append((members, shared.shape[3]))
    queries = torch.randn(row, heads, head_dim, generator=generator) * 2
    work = torch.zeros(decode_work_floats(heads, kv_heads, head_dim, max(lengths)))
    out, lse = torch.full_like(queries, float("nan")), torch.full((row, heads), float("nan"))
    assert kernels.decode_attention_groups(queries, buffers_at(buffers, lengths), groups, 0.2, out, lse, work)
    alone, alone_lse = torch.empty_like(out), torch.empty_like(lse)
    views = [(k[:, :, :n], v[:, :, :n]) for (k, v), n in zip(buffers, lengths, strict=True)]
    assert kernels.decode_attention(queries, views, 0.2, alone, alone_lse, work)
    assert close(out, alone) and torch.allclose(lse, alone_lse, atol=1e-5, rtol=1e-5)


def test_groups_the_decode_attention_does_not_take_are_refused(kernels: CpuKernels) -> None:
    generator = torch.Generator().manual_seed(9)
    buffers = [tuple(torch.randn(2, 1, 2, 50, 64, generator=generator)) for _ in range(3)]
    rows, queries = buffers_at(buffers, [20, 30, 40]), torch.randn(3, 4, 64, generator=generator)
    out, lse, work = torch.empty_like(queries), torch.empty(3, 4), torch.zeros(decode_work_floats(4, 2, 64, 40))
    for groups in ([((0, 1), 10), ((1, 2), 10)],  # a row in two groups
                   [((0, 1), 20)],  # no own row left to row 0
                   [((0,), 10)],  # one member
                   [((0, 3), 10)]):  # no row 3
        assert not kernels.decode_attention_groups(queries, rows, groups, 0.1, out, lse, work), groups
    assert not kernels.decode_attention_groups(queries, rows, [((0, 1), 10)], 0.1, out, lse, work[:100])


def test_decode_attention_refuses_shapes_it_does_not_take(kernels: CpuKernels) -> None:
    keys = torch.randn(1, 2, 10, 48)  # head_dim 48
    out, lse = torch.empty(1, 2, 48), torch.empty(1, 2)
    assert not kernels.decode_attention(torch.randn(1, 2, 48), [(keys, keys)], 0.1, out, lse, torch.zeros(100))
    keys = torch.randn(1, 2, 10, 64)
    too_small = torch.zeros(5)
    assert not kernels.decode_attention(torch.randn(1, 2, 64), [(keys, keys)], 0.1, torch.empty(1, 2, 64), lse,
                                        too_small)


def test_a_steps_new_rows_go_into_each_rows_own_buffer_at_its_own_row(kernels: CpuKernels) -> None:
    """Three sequences' buffers (heads 40 rows apart, as a lane's view of a longer buffer), each written at its
    own next row from one `[3, kv_heads, 1, head_dim]` step whose values are laid out as transformers' are;
    nothing else changes, and the rows then attend as views of the same buffers do."""
    generator = torch.Generator().manual_seed(3)
    kv_heads, head_dim, positions = 2, 64, [0, 7, 39]
    buffers = [(torch.randn(1, kv_heads, 40, head_dim, generator=generator),
                torch.randn(1, kv_heads, 40, head_dim, generator=generator)) for _ in positions]
    before = [(keys.clone(), values.clone()) for keys, values in buffers]
    keys = torch.randn(3, kv_heads, 1, head_dim, generator=generator)
    values = torch.randn(3, 1, kv_heads, head_dim, generator=generator).transpose(1, 2)  # strides (128, 64, 128, 1)
    rows = RowsAt([k.data_ptr() for k, _ in buffers], [v.data_ptr() for _, v in buffers],
                  [k.stride(1) for k, _ in buffers], [p + 1 for p in positions], kv_heads)
    assert kernels.append_rows(keys, values, rows, positions)
    for row, ((k, v), (k0, v0), at) in enumerate(zip(buffers, before, positions, strict=True)):
        assert torch.equal(k[0, :, at], keys[row, :, 0]) and torch.equal(v[0, :, at], values[row, :, 0])
        mask = torch.ones(40, dtype=torch.bool)
        mask[at] = False
        assert torch.equal(k[:, :, mask], k0[:, :, mask]) and torch.equal(v[:, :, mask], v0[:, :, mask])
    q = torch.randn(3, 4, head_dim, generator=generator)
    by_address, by_view = torch.empty_like(q), torch.empty_like(q)
    lse_address, lse_view = torch.empty(3, 4), torch.empty(3, 4)
    work = torch.zeros(decode_work_floats(4, kv_heads, head_dim, 40))
    assert kernels.decode_attention_at(q, rows, 0.125, by_address, lse_address, work)
    views = [(k[:, :, :p + 1], v[:, :, :p + 1]) for (k, v), p in zip(buffers, positions, strict=True)]
    assert kernels.decode_attention(q, views, 0.125, by_view, lse_view, work)
    assert torch.equal(by_address, by_view) and torch.equal(lse_address, lse_view)
    assert not kernels.append_rows(keys.double(), values.double(), rows, positions)
    assert not kernels.append_rows(keys, values, rows, positions[:2])


@pytest.mark.parametrize("cuts", [(300,), (100, 200), (1, 37, 262), (150, 140, 10)])
def test_attention_over_pieces_matches_one_tensor(kernels: CpuKernels, cuts: tuple[int, ...]) -> None:
    """Keys and values in pieces (a restored prefix, then the working buffer) give what one tensor gives;
    the last piece holds all 24 queries' own keys, or (150, 140, 10) splits them across two pieces."""
    generator = torch.Generator().manual_seed(sum(cuts))
    tokens, heads, kv_heads, head_dim, length = 24, 4, 2, 64, 300
    keys = torch.randn(1, kv_heads, length, head_dim, generator=generator)
    values = torch.randn(1, kv_heads, length, head_dim, generator=generator)
    q = torch.randn(tokens, heads, head_dim, generator=generator)
    whole = torch.empty(tokens, heads * head_dim)
    assert kernels.attention(q, [(keys, values)], length - tokens, 0.125, whole)
    pieces, position = [], 0
    for cut in cuts:
        # Each piece in its own memory, as stored spans are; the last one a view of a longer buffer.
        buffer_keys = torch.zeros(1, kv_heads, cut + 5, head_dim)
        buffer_values = torch.zeros(1, kv_heads, cut + 5, head_dim)
        buffer_keys[:, :, :cut] = keys[:, :, position:position + cut]
        buffer_values[:, :, :cut] = values[:, :, position:position + cut]
        pieces.append((buffer_keys[:, :, :cut], buffer_values[:, :, :cut]))
        position += cut
    out = torch.empty(tokens, heads * head_dim)
    assert kernels.attention(q, pieces, length - tokens, 0.125, out)
    assert close(out, whole)


def test_attention_refuses_shapes_it_does_not_take(kernels: CpuKernels) -> None:
    keys = torch.randn(1, 2, 20, 16)
    out = torch.zeros(4, 2 * 16)
    assert not kernels.attention(torch.randn(4, 2, 16), [(keys, keys)], 16, 0.25, out)  # head_dim 16
    keys = torch.randn(1, 2, 100, 32)
    assert not kernels.attention(torch.randn(70, 2, 32), [(keys, keys)], 30, 0.2, torch.zeros(70, 64))  # > 64 queries
    assert not kernels.attention(torch.randn(4, 2, 32), [(keys, keys)], 50, 0.2, torch.zeros(4, 64))  # length
    assert not kernels.attention(torch.randn(4, 2, 32), [(keys[..., :16], keys[..., :16])], 96, 0.2,
                                 torch.zeros(4, 64))  # head_dim of the keys differs
    assert not out.any()


def test_rmsnorm_rope_and_silu_match_torch(kernels: CpuKernels) -> None:
    generator = torch.Generator().manual_seed(2)
    x, weight = torch.randn(5, 72, generator=generator), torch.randn(72, generator=generator)
    out = torch.empty(5, 72)
    kernels.rmsnorm(x, weight, 1e-6, out)
    assert close(out, weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))

    rows, heads, head_dim = 3, 5, 64
    x = torch.randn(rows, heads * head_dim + 7, generator=generator)  # a row holds more than the heads
    angles = torch.randn(rows, head_dim // 2, generator=generator)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    heads_view = x[:, :heads * head_dim].view(rows, heads, head_dim)
    rotated = torch.cat([-heads_view[..., head_dim // 2:], heads_view[..., :head_dim // 2]], -1)
    expected, tail = heads_view * cos[:, None] + rotated * sin[:, None], x[:, -7:].clone()
    kernels.rope(x, heads, head_dim, cos, sin)
    assert close(x[:, :heads * head_dim].view(rows, heads, head_dim), expected)
    assert torch.equal(x[:, -7:], tail)

    gate_up = torch.randn(4, 2 * 40, generator=generator) * 30  # large enough to reach exp's clamps
    out = torch.empty(4, 40)
    kernels.silu_mul(gate_up, out)
    assert close(out, F.silu(gate_up[:, :40]) * gate_up[:, 40:])


def test_the_library_screen_needs_exact_int8_products(kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """A product that adds pairs of u8 x s8 products in 16 bits (AVX-512 without VNNI) saturates on full-scale
    codes: the check at packing finds it, and so does a CPU without int8 dot products."""
    generator = torch.Generator().manual_seed(4)
    codes = torch.randint(-127, 128, (40, 64), generator=generator, dtype=torch.int8).t()
    if cpu_kernels.INT8_FLAGS[0] in (cpu_kernels._cpu_flags() or ()):
        assert cpu_kernels.int8_products_exact(codes)

    def saturating(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        products = (a.int() + 128)[:, :, None] * b.int()[None]
        pairs = (products[:, 0::2] + products[:, 1::2]).clamp(-32768, 32767)
        return pairs.sum(1) - 128 * b.int().sum(0)

    small = codes // 4  # pairs within 16 bits: the emulation is the exact product
    assert torch.equal(saturating(codes.t()[:3], small), codes.t()[:3].int() @ small.int())
    monkeypatch.setattr(torch, "_int_mm", saturating)
    assert not cpu_kernels.int8_products_exact(codes)
    weight = torch.randn(40, 64, generator=generator)
    assert kernels.pack_head(weight).rows is None
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset(cpu_kernels.REQUIRED_FLAGS))
    assert kernels.pack_head(weight).rows is None


@pytest.mark.parametrize("screen", SCREENS)
@pytest.mark.parametrize("rows", [2, 8, 11, 17])
def test_head_argmax_of_many_rows_gives_each_rows_own_argmax(kernels: CpuKernels, rows: int, screen: str) -> None:
    """One pass of the screen over several rows of x, the undecidable among them left to the caller alone."""
    generator = torch.Generator().manual_seed(rows)
    weight = adversarial_head(generator, 700, 64)
    head = kernels.pack_head(weight.t().contiguous().t())
    x = torch.randn(rows, 64, generator=generator) * 3
    x[1] = weight[7] * 20  # aimed at a nudged row
    x[rows - 1, 5] = float("nan")
    expected = [int(torch.argmax(head_logits(kernels, row, head))) for row in x[:-1]] + [None]
    assert screened(kernels, x, head, screen) == expected
    wide = torch.zeros(max(rows, LIBRARY_SCREEN_ROWS), 96)
    wide[:rows, :64] = x
    wide[rows:, :64] = x[0]
    assert screened(kernels, wide[:, :64], head, screen)[:rows] == expected  # rows 96 floats apart
