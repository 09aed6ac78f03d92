"""SAAP's fused GPU plan (indexer/kernels/saap.py) against the torch path of indexer/saap.py.

Without CUDA the kernels run through Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so CI checks their logic; shapes are small (C 8-64, hidden 24-64, N ~2000).
Inputs are fresh random draws (seeded); where the kernels must pick the same buckets as torch, the
test first checks the draw has no near-tie at the edge of the top-ℓ (gap > 1e-5, the scores agree
to ~1e-7), so exact equality is meaningful. The GPU test (no host sync, CUDA-graph replay) is
marked `gpu` and skipped here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from indexer.rope import apply_rope, undo_rope  # noqa: E402
from indexer import kernels  # noqa: E402,F401  (the interpreter fix, before any launch)
from indexer.selection import expand_clusters, probe_width, selectable  # noqa: E402
from indexer.base import DecodeContext, IndexReader, KVView, get_method  # noqa: E402
from indexer.kernels import saap as K  # noqa: E402
from indexer.saap_model import SaapModel, bucket_scores, csr_partition  # noqa: E402

THETA = 10000.0
DEV = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _weights(kvh: int, d: int, hd: int, c: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random f_q in `SaapModel.layer`'s form (fp32), scaled so that softmax rows are neither flat
    nor one-hot."""
    return {
        "centroids": torch.randn(kvh, c, d, generator=g),
        "w1": torch.randn(kvh, hd, d, generator=g) / d ** 0.5,
        "scale": 0.5 + torch.rand(kvh, hd, generator=g),
        "shift": 0.1 * torch.randn(kvh, hd, generator=g),
        "w2": torch.randn(kvh, c, hd, generator=g) / hd ** 0.5,
        "b2": 0.1 * torch.randn(kvh, c, generator=g),
        "centroid_scale": torch.full((kvh,), d ** -0.5),
    }


def _partition(kvh: int, n: int, c: int, g: torch.Generator, empty: int = 0):
    """order, offsets [KVH, C + 1] int32 of a random assignment (skewed sizes; `empty` buckets of
    every head get no key)."""
    w = torch.rand(c, generator=g) ** 3 + 0.01
    w[torch.randperm(c, generator=g)[:empty]] = 0
    assign = torch.multinomial(w, kvh * n, replacement=True, generator=g).view(kvh, n)
    order, offsets = csr_partition(assign, c)
    return order.to(torch.int32), offsets.to(torch.int32)


def _queries(kvh, grp, t, d, n_ctx, g, dtype=torch.float32):
    q_pos = n_ctx + torch.sort(torch.randperm(16, generator=g)[:t]).values
    q = apply_rope(torch.randn(kvh, grp, t, d, generator=g) * 2, q_pos, THETA)
    return q.to(dtype), q_pos


def _torch_scores(q, q_pos, w, probe):
    return bucket_scores(undo_rope(q.float(), q_pos, THETA), w, probe)  # [KVH, T, C]


def _edge_gap(score: torch.Tensor, p: int) -> float:
    """The smallest gap between the ℓ-th and (ℓ+1)-th score over rows (inf when ℓ = C)."""
    if p >= score.shape[-1]:
        return float("inf")
    top = torch.topk(score, p + 1, dim=-1).values
    return float((top[..., p - 1] - top[..., p]).min())


def _rank(q, q_pos, n_ctx, w32, offsets, p, probe, dtype=torch.float32):
    """rank_buckets on DEV (the interpreter on the CPU, compiled kernels on a GPU)."""
    q, q_pos, offsets = q.to(DEV), q_pos.to(DEV), offsets.to(DEV)
    cos, sin = K.rope_table(n_ctx, 16, q.shape[-1], THETA, DEV)
    w = {k: v.to(DEV) for k, v in w32.items()}
    return K.rank_buckets(q, q_pos, n_ctx, cos, sin, K.kernel_weights(w, dtype), offsets, p, probe)


def _check_tables(got: K.Probed, probe: torch.Tensor, offsets: torch.Tensor):
    """end / shift / size of the probed buckets, from the CSR offsets, in probe order."""
    off = offsets.long()
    kvh, t, p = probe.shape
    flat = probe.reshape(kvh, -1).long()
    start = off.gather(1, flat).view(kvh, t, p)
    size = off.gather(1, flat + 1).view(kvh, t, p) - start
    end = size.cumsum(-1)
    assert torch.equal(got.size.cpu().long(), size) and torch.equal(got.end.cpu().long(), end)
    assert torch.equal(got.shift.cpu().long(), start - (end - size))


# ---------------------------------------------------------------------------------------------
# Kernels 1-3: f_q, softmax, group sum, top-ℓ and the probe table


@pytest.mark.parametrize("kvh,grp,t,d,hd,c,p,probe", [
    (2, 4, 1, 32, 64, 64, 8, "classifier"),  # the 8B layout in small: G 4, T 1
    (3, 3, 1, 64, 40, 48, 5, "classifier"),  # SmolLM2's G 3 and D 64; hidden and C not powers of two
    (2, 4, 3, 16, 24, 37, 37, "classifier"),  # T > 1 (a question step); ℓ = C: every bucket, all ranked
    (2, 4, 5, 32, 48, 40, 6, "classifier"),  # G·T = 20 rows: two row blocks of 16
    (1, 1, 2, 32, 32, 9, 1, "classifier"),  # one query head, ℓ = 1
    (2, 4, 2, 32, 64, 64, 6, "centroid"),  # the k-means baseline: softmax(q'·c / sqrt(D))
])
def test_rank_buckets_match_torch_topk(kvh, grp, t, d, hd, c, p, probe):
    """fp32 weights: the logits equal torch's (f_q, or the scaled centroid similarity) to 1e-5
    (fp32 summation order; measured ~1e-6), and the probe table holds torch.topk's buckets, in its
    order (score descending), with their sizes and places in the plan row."""
    g = torch.Generator().manual_seed(kvh * 1000 + grp * 100 + t * 10 + c)
    n_ctx = 1500
    w = _weights(kvh, d, hd, c, g)
    order, offsets = _partition(kvh, n_ctx, c, g, empty=2)
    q, q_pos = _queries(kvh, grp, t, d, n_ctx, g)
    score = _torch_scores(q, q_pos, w, probe)
    assert _edge_gap(score, p) > 1e-5  # tie-free draw: equality below is meaningful
    got = _rank(q, q_pos, n_ctx, w, offsets, p, probe)
    qd = undo_rope(q, q_pos, THETA)
    if probe == "classifier":
        hid = torch.relu(torch.einsum("hgtd,hkd->hgtk", qd, w["w1"]) * w["scale"][:, None, None]
                         + w["shift"][:, None, None])
        logits = (torch.einsum("hgtk,hck->hgtc", hid, w["w2"]) + w["b2"][:, None, None]
                  + w["centroid_scale"][:, None, None, None] * torch.einsum("hgtd,hcd->hgtc", qd, w["centroids"]))
    else:
        logits = torch.einsum("hgtd,hcd->hgtc", qd, w["centroids"]) * d ** -0.5
    torch.testing.assert_close(got.logits.cpu(), logits, atol=1e-5, rtol=1e-5)
    want = torch.topk(score, p, dim=-1, sorted=True).indices
    assert torch.equal(got.probe.cpu().long(), want)
    _check_tables(got, want, offsets)


def test_bf16_weights_rank_like_torch_on_rounded_weights():
    """The planner's default: w1, w2 and centroids read in bf16. The kernels then compute what torch
    computes with the same rounded weights (same top-ℓ on a tie-free draw). Against the fp32 weights
    the logits move by the rounding, each weight by <= 2^-9 of itself, so |Δlogit| <= 2^-9 (|w2|·|h|
    + |w2|·(scale ⊙ |w1|·|q'|) + cs·|c|·|q'|) to first order (h moves through w1's rounding; relu is
    1-Lipschitz). Measured: max |Δlogit| 1.8e-2 for logits up to 10, ~0.1 of that bound (errors of
    random sign); the top-ℓ may then differ at near-ties of that size only."""
    g = torch.Generator().manual_seed(3)
    kvh, grp, t, d, hd, c, p, n_ctx = 2, 4, 2, 64, 64, 64, 8, 1200
    w = _weights(kvh, d, hd, c, g)
    order, offsets = _partition(kvh, n_ctx, c, g)
    q, q_pos = _queries(kvh, grp, t, d, n_ctx, g, torch.bfloat16)
    rounded = {k: v.float() for k, v in K.kernel_weights(w, torch.bfloat16).items()}
    score = _torch_scores(q, q_pos, rounded, "classifier")
    assert _edge_gap(score, p) > 1e-5
    got = _rank(q, q_pos, n_ctx, w, offsets, p, "classifier", torch.bfloat16)
    assert torch.equal(got.probe.cpu().long(), torch.topk(score, p, dim=-1).indices)
    bf16_logits = got.logits.cpu().clone()  # a view of the workspace: the next call overwrites it
    exact = _rank(q, q_pos, n_ctx, w, offsets, p, "classifier").logits.cpu()  # fp32 weights
    diff = (bf16_logits - exact).abs()
    qd = undo_rope(q.float(), q_pos, THETA)
    a = {k: v.abs() for k, v in w.items()}
    hid = torch.relu(torch.einsum("hgtd,hkd->hgtk", qd, w["w1"]) * w["scale"][:, None, None]
                     + w["shift"][:, None, None])
    dh = a["scale"][:, None, None] * torch.einsum("hgtd,hkd->hgtk", qd.abs(), a["w1"])  # |Δh| through w1's rounding
    sim = torch.einsum("hgtd,hcd->hgtc", qd.abs(), a["centroids"])
    bound = 2.0 ** -9 * (torch.einsum("hgtk,hck->hgtc", hid + dh, a["w2"])
                         + a["centroid_scale"][:, None, None, None] * sim)
    print(f"bf16 weights: max |Δlogit| vs fp32 {float(diff.max()):.2e} (logits up to {float(exact.abs().max()):.2f}), "
          f"max ratio to the first-order bound {float((diff / bound).max()):.3f}")
    assert float(diff.max()) > 0 and (diff <= 1.01 * bound + 1e-6).all()


def test_ties_rank_by_bucket_id():
    """Buckets with identical weights (equal scores, bit for bit) are ranked lowest id first; the
    probed ids are distinct and the table covers ℓ buckets."""
    g = torch.Generator().manual_seed(5)
    kvh, grp, d, hd, c, p, n_ctx = 2, 2, 16, 16, 16, 6, 600
    w = _weights(kvh, d, hd, c, g)
    for k in ("centroids", "w2", "b2"):  # buckets 3, 7, 12 are copies of bucket 9
        w[k][:, [3, 7, 12]] = w[k][:, 9:10]
    w["b2"][:, [3, 7, 9, 12]] += 50.0  # ... and the four outrank every other bucket
    order, offsets = _partition(kvh, n_ctx, c, g)
    q, q_pos = _queries(kvh, grp, 1, d, n_ctx, g)
    got = _rank(q, q_pos, n_ctx, w, offsets, p, "classifier")
    assert (got.probe.cpu()[..., :4] == torch.tensor([3, 7, 9, 12], dtype=torch.int32)).all()
    assert all(len(set(row.tolist())) == p for row in got.probe.cpu().reshape(-1, p))


# ---------------------------------------------------------------------------------------------
# Kernel 4: the plan row from the probe table


def _probed(probe: torch.Tensor, offsets: torch.Tensor) -> K.Probed:
    """A probe table for given probed buckets (what kernels 1-3 write), made in torch."""
    off = offsets.long()
    kvh, t, p = probe.shape
    flat = probe.reshape(kvh, -1).long()
    start = off.gather(1, flat).view(kvh, t, p)
    size = off.gather(1, flat + 1).view(kvh, t, p) - start
    end = size.cumsum(-1)
    i32 = lambda x: x.to(DEV, torch.int32).contiguous()  # noqa: E731
    return K.Probed(i32(probe), i32(end), i32(start - (end - size)), i32(size), torch.empty(0))


def _torch_record(positions_ok, probed, q_pos, n, sink, window):
    s_end = min(sink, n)
    w_lo = (q_pos.long() - window + 1).clamp(min=s_end, max=n)
    frame = s_end + (n - w_lo) + (q_pos.long() - n + 1).clamp(min=0)
    visited = (frame[None] + positions_ok.sum(-1)).double() / (q_pos[None].double() + 1)
    return float(visited.mean()), float(probed.size.max())


@pytest.mark.parametrize("case", ["plain", "empty_buckets", "all_buckets", "one_bucket", "wide_frame",
                                  "truncated", "tokens", "width_zero_rows"])
def test_expand_matches_expand_clusters(case):
    """The plan row == `expand_clusters` + `selectable` (the torch path), slot for slot: -1 padding
    after the probed keys, keys inside the sink or the window masked, the width fixed by the caller
    (`probe_width`; a smaller one keeps the first keys, as expand_clusters does). Also the
    selectivity record the last program writes, against the torch planner's formula."""
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    kvh, t, c, p, n, sink, window = 3, 1, 32, 5, 2000, 2, 40
    empty = 0
    if case in ("empty_buckets", "width_zero_rows"):
        empty = 12  # probed buckets with no key: they take no slot
    elif case == "all_buckets":
        p = c
    elif case == "one_bucket":
        p = 1
    elif case == "wide_frame":
        sink, window = 300, 1500  # most probed keys lie in the frame: masked to -1
    elif case == "tokens":
        t = 4  # a question step: every token has its row and its window
    order, offsets = _partition(kvh, n, c, g, empty=empty)
    probe = torch.stack([torch.stack([torch.randperm(c, generator=g)[:p] for _ in range(t)]) for _ in range(kvh)])
    sizes = offsets[:, 1:] - offsets[:, :-1]
    zero = (sizes[0] == 0).nonzero().flatten()  # the same buckets are empty in every head
    if case == "empty_buckets":  # two empty buckets among the probed ones, at slots 1 and 3
        full = (sizes[0] > 0).nonzero().flatten()
        for h in range(kvh):
            probe[h, 0] = torch.cat([full[torch.randperm(len(full), generator=g)[:p]]])
            probe[h, 0, 1], probe[h, 0, 3] = zero[h], zero[h + 3]
    if case == "width_zero_rows":  # head 0 probes only empty buckets: an all -1 row
        probe[0, 0] = zero[:p]
    width = probe_width(offsets, p)
    if case == "truncated":
        width = width // 3
    q_pos = n + torch.arange(t) * 7
    tab = _probed(probe, offsets)
    rec = torch.full((8, 3, 2), float("nan"), dtype=torch.float64, device=DEV)
    lengths = torch.full((kvh, t), -7, dtype=torch.int32, device=DEV)
    got = K.expand_probed(tab, order.to(DEV), q_pos.to(DEV), n, sink, window, width, rec, rec_col=1,
                          lengths=lengths).cpu()
    rec, lengths = rec.cpu(), lengths.cpu()
    keys = expand_clusters(probe, order, offsets, width)
    ok = selectable(keys, q_pos, n, sink, window)
    want = torch.where(ok, keys, -1).to(torch.int32)
    assert got.shape == (kvh, t, width) and torch.equal(got, want)
    # lengths: the probed buckets' total, capped at the width; every slot past it is -1
    total = torch.stack([torch.stack([(offsets[h, probe[h, i] + 1] - offsets[h, probe[h, i]]).sum()
                                      for i in range(t)]) for h in range(kvh)])
    assert torch.equal(lengths, total.clamp(max=width).to(torch.int32))
    assert (got[torch.arange(width) >= lengths[..., None]] == -1).all()
    if case == "wide_frame":
        assert (want == -1).float().mean() > 0.5 and (want >= 0).any()
    if case == "width_zero_rows":
        assert (got[0] == -1).all() and (got[1:] >= 0).any()
    mean, largest = _torch_record(ok, tab, q_pos, n, sink, window)
    step = min(int(q_pos[-1]) - n, 7)
    assert abs(float(rec[step, 1, 0]) - mean) < 1e-12 and float(rec[step, 1, 1]) == largest
    assert torch.isnan(rec[:, [0, 2]]).all() and torch.isnan(rec[torch.arange(8) != step]).all()


def test_expand_width_zero():
    """K = 0 (a plan with no slots): an empty row, and the record is still written."""
    g = torch.Generator().manual_seed(9)
    order, offsets = _partition(2, 300, 8, g)
    probe = torch.tensor([[[1, 2]], [[0, 5]]])
    rec = torch.full((4, 1, 2), float("nan"), dtype=torch.float64, device=DEV)
    got = K.expand_probed(_probed(probe, offsets), order.to(DEV), torch.tensor([301], device=DEV), 300, 1, 8, 0, rec)
    rec = rec.cpu()
    assert got.shape == (2, 1, 0) and not torch.isnan(rec[1, 0]).any() and torch.isnan(rec[0]).all()


# ---------------------------------------------------------------------------------------------
# The planner: kernels vs torch path, several steps


@pytest.fixture(scope="module")
def synthetic_index(tmp_path_factory):
    """A synthetic trained model (k-means on mixture keys, random f_q: C = 48, hidden 40) over a
    2,000-token structured capture; 2 layers (layer 1 trained), KVH 2, G 3, D 32."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from synthetic import Mixture, model_spec, structured_capture, write_saap_model

    spec = model_spec(2, 6, 2, 32, THETA, "kernels-saap")
    mix = Mixture(spec, "cpu", seed=0, comps=64)
    model_dir = write_saap_model(tmp_path_factory.mktemp("saap-kernels"), spec, mix, layers=[1], clusters=48,
                                 hidden=40, sample=2048)
    n = 2000
    cap = structured_capture(spec, n + 16, "cpu", mixture=mix)
    return spec, model_dir, cap, n


def _open(spec, model_dir, cap, n, **kw):
    m = get_method("saap")
    params = m.Params(model_dir=str(model_dir), **kw)
    arrays = {k: v.to(DEV) for k, v in m.build(type(cap)(q=cap.q[:, :, :n], k=cap.k[:, :, :n], v=cap.v[:, :, :n],
                                                         positions=cap.positions[:n], spec=spec), params).items()}
    reader = IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))
    ctx = DecodeContext(n, spec, 16)
    return m.open(reader, params, ctx), m.open(reader, params, ctx), params


def _step(cap, n, i, t=1):
    """Query tokens n + i .. n + i + t - 1 of layer 1 (request tokens at those positions)."""
    p = n + i
    q = cap.q[1, :, p:p + t].reshape(2, 3, t, 32).to(DEV)
    kv = KVView(cap.k[1, :, :n].to(DEV), cap.v[1, :, :n].to(DEV), cap.k[1, :, n:p + t].to(DEV),
                cap.v[1, :, n:p + t].to(DEV), torch.arange(p, p + t, device=DEV))
    return q, kv


@pytest.mark.parametrize("probe,nprobe,weights", [("classifier", 5, "fp32"), ("classifier", 7, "bf16"),
                                                  ("centroid", 4, "fp32")])
def test_planner_kernels_plan_like_torch(synthetic_index, probe, nprobe, weights):
    """`plan` through the kernels (`use_kernels`) == the torch path, slot for slot, over 4 decode
    steps and a 3-token question step, and the same stats. fp32: the kernels with the fp32 weights;
    bf16: the kernels' default weights vs the torch path on the same rounded weights. Every draw is
    checked tie-free at the edge of the top-ℓ first."""
    spec, model_dir, cap, n = synthetic_index
    ref, fused, params = _open(spec, model_dir, cap, n, probe=probe, nprobe=nprobe, recent=24)
    model = SaapModel.open(model_dir)
    ref.use_kernels, fused.use_kernels = False, True
    if weights == "fp32":
        fused.kernel_weight_dtype = torch.float32
    else:
        ref._w[1] = {k: v.float() for k, v in model.kernel_layer(1, DEV, torch.bfloat16).items()}
    w = ref._w[1] if 1 in ref._w else model.layer(1, DEV)
    filled = 0
    for i, t in [(0, 1), (1, 1), (2, 1), (3, 1), (4, 3)]:
        q, kv = _step(cap, n, i, t)
        score = bucket_scores(undo_rope(q.float(), kv.q_pos, spec.rope_theta), w, probe)
        assert _edge_gap(score.cpu(), nprobe) > 1e-5, (i, t)
        a, b = ref.plan(1, q, kv).positions, fused.plan(1, q, kv).positions
        assert a.shape == b.shape == (2, t, probe_width(ref.index.layer("offsets", 1), nprobe))
        assert torch.equal(a, b), (i, t)
        filled += int((b >= 0).sum())
        assert ref.plan(0, q, kv).is_dense and fused.plan(0, q, kv).is_dense
    assert filled > 0
    sa, sb = ref.stats(), fused.stats()
    assert sa["largest_probed_bucket"] == sb["largest_probed_bucket"] > 0
    assert len(sa["selectivity_per_step"]) == len(sb["selectivity_per_step"]) == 5
    assert all(abs(x - y) < 1e-9 for x, y in zip(sa["selectivity_per_step"], sb["selectivity_per_step"]))


def test_planner_opens_the_kernels_only_on_a_gpu(synthetic_index):
    """open() picks the kernels for an index on CUDA (Triton present, shape supported), the torch path
    elsewhere; unsupported shapes say why."""
    spec, model_dir, cap, n = synthetic_index
    a, _, _ = _open(spec, model_dir, cap, n)
    assert a.use_kernels == (DEV == "cuda")
    assert K.unsupported(32, 3, 48, 5) == []
    assert K.unsupported(96, 3, 48, 5) and K.unsupported(32, 3, 48, 49) and K.unsupported(32, 65, 48, 5)


# ---------------------------------------------------------------------------------------------
# GPU: no host sync, CUDA-graph replay


@pytest.mark.gpu
def test_gpu_plan_is_sync_free_and_graph_replayable(tmp_path):
    """On CUDA the planner runs the kernels by default (bf16 weights): the plan equals the torch
    path's on the same rounded weights, makes no host sync (set_sync_debug_mode("error")), and a
    CUDA graph of it replayed on new queries gives the eager plan of those queries and its record.
    8B-like layout in small: KVH 8, G 4, D 128, C 64, hidden 128, N 8192."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from synthetic import Mixture, llama8b_spec, structured_capture, write_saap_model

    spec = llama8b_spec(2)
    mix = Mixture(spec, "cuda", seed=0)
    model_dir = write_saap_model(tmp_path / "m", spec, mix, layers=[1], clusters=64, hidden=128, sample=8192)
    n, steps = 8192, 6
    cap = structured_capture(spec, n + steps, "cuda", mixture=mix, dtype=torch.bfloat16)
    m = get_method("saap")
    params = m.Params(model_dir=str(model_dir), nprobe=8)
    ctx_cap = type(cap)(q=cap.q[:, :, :n], k=cap.k[:, :, :n], v=cap.v[:, :, :n], positions=cap.positions[:n], spec=spec)
    arrays = {k: v.cuda() for k, v in m.build(ctx_cap, params).items()}
    reader = IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))
    dctx = DecodeContext(n, spec, 64)
    fused, ref, graphed = (m.open(reader, params, dctx) for _ in range(3))
    assert fused.use_kernels and graphed.use_kernels
    ref.use_kernels = False
    ref._w[1] = {k: v.float() for k, v in SaapModel.open(model_dir).kernel_layer(1, "cuda").items()}

    def inputs(i):
        p = n + i
        q = cap.q[1, :, p:p + 1].reshape(8, 4, 1, 128).contiguous()
        kv = KVView(cap.k[1, :, :n], cap.v[1, :, :n], cap.k[1, :, n:n + steps], cap.v[1, :, n:n + steps],
                    torch.tensor([p], device="cuda"))
        return q, kv

    eager = {}
    for i in range(steps):
        q, kv = inputs(i)
        if i > 0:
            torch.cuda.set_sync_debug_mode("error")
        try:
            eager[i] = fused.plan(1, q, kv).positions.clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(eager[i], ref.plan(1, q, kv).positions), i
    q0, kv0 = inputs(0)
    q_buf, pos_buf = q0.clone(), kv0.q_pos.clone()
    kv_buf = KVView(kv0.ctx_k, kv0.ctx_v, kv0.loc_k, kv0.loc_v, pos_buf)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            graphed.plan(1, q_buf, kv_buf)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = graphed.plan(1, q_buf, kv_buf).positions
    for i in reversed(range(steps)):
        q, kv = inputs(i)
        q_buf.copy_(q)
        pos_buf.copy_(kv.q_pos)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager[i]), i
    sf, sg = fused.stats(), graphed.stats()
    assert sf["selectivity_per_step"] == sg["selectivity_per_step"] and len(sf["selectivity_per_step"]) == steps
    assert sf["largest_probed_bucket"] == sg["largest_probed_bucket"]
