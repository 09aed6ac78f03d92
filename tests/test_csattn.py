"""CSAttention (`indexer/csattn.py`): recall and fidelity on the real model, exactness on synthetic
data, streaming updates, request isolation, params validation, GPU == CPU.

The 2K-document index is built once per module (15-35 s on one core of the shared VM) and
shared: the recall measurement (`selection_recall`) would otherwise rebuild it per call. The whole
module took 53-130 s there, depending on the other workers' load.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from pydantic import ValidationError

from decoder.attention import dense_attention, merge_selection, sparse_attention
from decoder.fidelity import fidelity, selection_recall, teacher_forced_logits, truncate_capture
from decoder.generate import ContextKV
from indexer.base import IndexReader, KVView, MethodParams, PrefillCapture, get_method
from indexer.csattn import CSAttention, CSAttnParams, build_layer, effective_lists

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_CONT = 64  # teacher-forced fidelity positions after the 1984-token context
N_RECALL = 16  # replayed decode queries for recall (tokens 1984..1999: the same index)
PAPER = {"missing_score": "zero", "subspace_weights": "uniform"}  # the paper's reduce-by-key


class _Prebuilt(CSAttention):
    """csattn whose `build` returns an index built once (same build params, same context)."""

    def __init__(self, arrays: dict, n_tokens: int):
        self.arrays, self.n_tokens = arrays, n_tokens

    def build(self, prefill, params, env=None):
        assert prefill.n_tokens == self.n_tokens and params.build_params() == CSAttnParams().build_params()
        return self.arrays


@pytest.fixture(scope="module")
def doc_index(captured_2k):
    """(context capture, csattn index) for the 2K document minus its last N_CONT tokens."""
    ctx = truncate_capture(captured_2k, captured_2k.n_tokens - N_CONT)
    return ctx, get_method("csattn").build(ctx, CSAttnParams())


def _reader(arrays: dict) -> IndexReader:
    return IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))


# ---------------------------------------------------------------------------------------------
# real model


def test_build_layout(doc_index, lm):
    ctx, arr = doc_index
    spec, n = lm.spec, ctx.n_tokens
    lk = math.ceil(0.2 * n)
    assert arr["centroids"].shape == (spec.num_layers, spec.num_kv_heads, 8, 64, spec.head_dim // 8)
    assert arr["idx"].shape == arr["score"].shape == (spec.num_layers, spec.num_kv_heads, 8, 64, lk)
    assert (arr["centroids"].dtype, arr["idx"].dtype, arr["score"].dtype) == (torch.float16, torch.int32, torch.float16)
    assert torch.allclose(arr["centroids"].float().norm(dim=-1), torch.ones(1), atol=2e-3)
    s = arr["score"].float()
    assert (s[..., 1:] <= s[..., :-1]).all(), "lists must be sorted by score, descending"
    assert int(arr["idx"].min()) >= 0 and int(arr["idx"].max()) < n
    # spot check one list against a brute-force score of every key
    layer, h, b, j = 7, 1, 3, 5
    c = arr["centroids"][layer, h, b, j].float()
    ref = ctx.k[layer, h, :, b * 8:(b + 1) * 8].float() @ c
    assert torch.allclose(s[layer, h, b, j], ref.topk(lk).values, rtol=2e-3, atol=2e-3)


def test_recall_real_qk(doc_index, captured_2k):
    ctx, arr = doc_index
    method = _Prebuilt(arr, ctx.n_tokens)
    cap = truncate_capture(captured_2k, ctx.n_tokens + N_RECALL)
    out = {}
    for name, extra in (("default", {}), ("paper", PAPER)):
        for rho in (0.05, 0.10):
            rep = selection_recall(method, CSAttnParams(rho=rho, **extra), cap, n_queries=N_RECALL, ratio=rho)
            out[name, rho] = rep
            print(f"\ncsattn[{name}] rho={rho}: {rep.summary()}")
    for rho in (0.05, 0.10):
        base = selection_recall(get_method("streaming"), get_method("streaming").Params(window=32), cap,
                                n_queries=N_RECALL, ratio=rho)
        print(f"streaming (sink 4 + window 32) rho={rho}: recall {base.summary()['recall']:.4f}")
        assert out["paper", rho].recall.mean() > base.recall.mean() + 0.1
    # measured 2026-11-21 (SmolLM2-135M, 1984-token context, 16 queries, mean over 30 layers):
    # default 0.629 / 0.592, paper 0.362 / 0.350, streaming 0.217 / 0.130 at rho 5% / 10%
    assert out["default", 0.05].recall.mean() >= 0.58
    assert out["default", 0.10].recall.mean() >= 0.54
    assert out["paper", 0.05].recall.mean() >= 0.32
    assert out["paper", 0.10].recall.mean() >= 0.31
    assert (out["default", 0.05].recall >= 0.35).all(), "a layer with little recall"  # worst layer: 0.452
    # CPU<->GPU lookahead: each step attends the selection planned with the previous token's query
    stale = selection_recall(method, CSAttnParams(rho=0.05, mode="offload", overlap="lookahead", host_workers=2),
                             cap, n_queries=N_RECALL, ratio=0.05)
    print(f"csattn[lookahead] rho=0.05: {stale.summary()}")
    # measured 2026-11-22: 0.554 (worst layer 0.251) vs 0.629 with the current query; over 64
    # queries 0.565 vs 0.637. Its model-level cost is larger (results file: top-1 0.52 vs 0.83).
    assert 0.50 <= stale.recall.mean() < out["default", 0.05].recall.mean()
    assert float(out["default", 0.05].touched.mean()) < 0.075  # sink + window + 5%: 0.068


def test_fidelity_real_model(doc_index, captured_2k, lm):
    from conftest import natural_document

    ctx, arr = doc_index
    n = ctx.n_tokens
    ids = lm.context_ids(natural_document(1750))[: captured_2k.n_tokens]
    cont = ids[n:]
    assert len(cont) == N_CONT
    kv = ContextKV(n, lambda name, layer: {"kv/k": ctx.k, "kv/v": ctx.v}[name][layer])
    ref = teacher_forced_logits(lm, kv, get_method("full").open(None, MethodParams(), n), MethodParams(), cont)
    p = CSAttnParams()
    res = fidelity(ref, teacher_forced_logits(lm, kv, get_method("csattn").open(_reader(arr), p, n), p, cont))
    print(f"\ncsattn fidelity vs full over {N_CONT} positions: {res}")
    # measured 2026-11-21: top-1 0.828, mean KL 0.296. Same positions, for scale: exact top-5% oracle
    # 0.906 / 0.030, paper scoring 0.422 / 2.16, streaming (sink 4 + window 32) 0.359 / 2.72
    assert res["top1_agreement"] >= 0.75
    assert res["kl_mean"] <= 0.45


# ---------------------------------------------------------------------------------------------
# synthetic exactness


def _synthetic(n=64, kvh=2, g=2, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, kvh * g, n, d, generator=gen)
    k = torch.randn(1, kvh, n, d, generator=gen)
    v = torch.randn(1, kvh, n, d, generator=gen)
    return q, k, v


def test_full_lists_select_everything():
    """C >= number of queries, L = N, K = N: selection ∪ frame is every token; output = dense."""
    n, kvh, g, d = 64, 2, 2, 32
    q, k, v = _synthetic(n, kvh, g, d)
    p = CSAttnParams(m=4, n_centroids=kvh * g * n, list_len=n, k=n, sink=2, window=4)
    tables = build_layer(q[0], k[0], p, torch.Generator().manual_seed(0))
    arr = {name: t[None] for name, t in zip(("centroids", "idx", "score"), tables)}
    sess = get_method("csattn").open(_reader(arr), p, n)
    qd = torch.randn(kvh, g, 1, d)
    loc_k, loc_v = torch.randn(kvh, 1, d), torch.randn(kvh, 1, d)
    kv = KVView(k[0], v[0], loc_k, loc_v, torch.tensor([n]))
    sel = sess.select(0, qd, kv)
    # the method's own budget goes to tokens the frame would not attend anyway
    assert sorted(sel[0, 0][sel[0, 0] >= 0].tolist()) == list(range(p.sink, n + 1 - p.window))
    idx = merge_selection(sel, kv.q_pos, p.sink, p.window)
    assert sorted(idx[0, 0][idx[0, 0] >= 0].tolist()) == list(range(n + 1))
    assert sorted(idx[1, 0][idx[1, 0] >= 0].tolist()) == list(range(n + 1))
    out = sparse_attention(qd, idx, k[0], v[0], loc_k, loc_v, d ** -0.5)
    ref = dense_attention(qd, k[0], v[0], loc_k, loc_v, d ** -0.5)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weights", ["uniform", "query_norm"])
def test_own_centroid_gives_exact_ranking(weights):
    """One query head per kv head and C = N training queries: every training query is its own
    centroid, so a training query finds its own sub-vectors. With L = N the ranking is then
    sum_b w_b q̂_b·k_b: exactly q·k (the exact top-K) for query_norm weights."""
    n, kvh, d, m, kk = 64, 2, 32, 4, 12
    q, k, v = _synthetic(n, kvh, 1, d, seed=3)
    p = CSAttnParams(m=m, n_centroids=n, list_len=n, k=kk, sink=0, window=0, subspace_weights=weights)
    tables = build_layer(q[0], k[0], p, torch.Generator().manual_seed(1))
    arr = {name: t[None] for name, t in zip(("centroids", "idx", "score"), tables)}
    sess = get_method("csattn").open(_reader(arr), p, n)
    ds = d // m
    for t in (5, 40, 63):
        qd = q[0, :, t].reshape(kvh, 1, 1, d)
        kv = KVView(k[0], v[0], k[0, :, :0], v[0, :, :0], torch.tensor([n - 1]))
        sel = sess.select(0, qd, kv)[:, 0]  # [KVH, K]
        qs = qd.reshape(kvh, m, ds)
        qhat = qs / qs.norm(dim=-1, keepdim=True)
        w = qs.norm(dim=-1) if weights == "query_norm" else torch.ones(kvh, m)
        ref = torch.einsum("hmd,hnmd,hm->hn", qhat, k[0].reshape(kvh, n, m, ds), w)
        if weights == "query_norm":
            assert torch.allclose(ref, torch.einsum("hd,hnd->hn", qd.reshape(kvh, d), k[0]), atol=1e-4)
        top = ref.topk(kk, dim=-1).values
        got = ref.gather(1, sel).sort(dim=-1, descending=True).values
        # the same set, up to near-ties (scores are stored in fp16)
        assert torch.allclose(got, top, atol=0.05), (got, top)


def test_list_min_missing_score_is_an_offset():
    """missing_score=list_min subtracts each gathered list's last score: with L = N every key is
    in every list, so the ranking is unchanged."""
    n, kvh, g, d = 48, 1, 2, 16
    q, k, v = _synthetic(n, kvh, g, d, seed=5)
    base = dict(m=4, n_centroids=8, list_len=n, k=10, sink=0, window=0)
    tables = build_layer(q[0], k[0], CSAttnParams(**base), torch.Generator().manual_seed(0))
    arr = {name: t[None] for name, t in zip(("centroids", "idx", "score"), tables)}
    qd = torch.randn(kvh, g, 1, d)
    kv = KVView(k[0], v[0], k[0, :, :0], v[0, :, :0], torch.tensor([n - 1]))
    sels = [get_method("csattn").open(_reader(arr), CSAttnParams(**base, missing_score=ms), n).select(0, qd, kv)
            for ms in ("zero", "list_min")]
    assert sorted(sels[0].flatten().tolist()) == sorted(sels[1].flatten().tolist())


# ---------------------------------------------------------------------------------------------
# streaming updates and request isolation


@pytest.fixture
def small_index():
    n, kvh, g, d = 256, 2, 2, 16
    q, k, v = _synthetic(n, kvh, g, d, seed=7)
    cap = PrefillCapture(q=q, k=k, v=v, positions=torch.arange(n), spec=None)
    p = CSAttnParams(m=4, n_centroids=8, list_len=32, k=4, sink=0, window=0)
    gen = torch.Generator().manual_seed(0)
    tables = build_layer(cap.q[0], cap.k[0], p, gen)
    arr = {name: t[None].clone() for name, t in zip(("centroids", "idx", "score"), tables)}
    return arr, p, (k, v)


def test_streaming_update_sorted_bounded_and_exact(small_index):
    arr, p, (k, v) = small_index
    n, kvh, d = k.shape[2], k.shape[1], k.shape[3]
    sess = get_method("csattn").open(_reader(arr), p, n)
    gen = torch.Generator().manual_seed(11)
    new_k, pos = [], []
    for t in (3, 1, 1, 5, 1, 20):  # a question chunk, decode steps, and more than fits in one list tail
        kk = 3 * torch.randn(kvh, t, d, generator=gen)
        pp = torch.arange(n + len(pos), n + len(pos) + t)
        sess.append(0, kk, kk, pp)
        new_k.append(kk)
        pos += pp.tolist()
    idx, score = sess.lists(0)
    assert idx.shape == score.shape == arr["idx"].shape[1:]  # bounded: capacity unchanged
    assert (score[..., 1:] <= score[..., :-1]).all(), "sorted descending"
    assert all(len(set(row)) == len(row) for row in idx.reshape(-1, idx.shape[-1]).tolist()), "no duplicates"
    assert (idx >= n).any(), "some appended key entered some list"
    # reference: top-L of (persisted entries ∪ every appended key scored against the centroid)
    cent = arr["centroids"][0].float()  # [KVH, m, C, ds]
    m, ds = cent.shape[1], cent.shape[-1]
    app = torch.einsum("hmcd,htmd->hmct", cent, torch.cat(new_k, dim=1).reshape(kvh, -1, m, ds))
    allv = torch.cat([arr["score"][0].float(), app.half().float()], dim=-1)
    assert torch.equal(score, allv.topk(idx.shape[-1], dim=-1).values)


def test_appended_best_match_is_found_and_sessions_are_isolated(small_index):
    arr, p, (k, v) = small_index
    n, kvh, d = k.shape[2], k.shape[1], k.shape[3]
    before = {name: t.clone() for name, t in arr.items()}
    cent = arr["centroids"][0].float()  # [KVH, m, C, ds]
    h, j = 1, 3
    star = torch.zeros(kvh, 1, d)
    star[h, 0] = 50 * cent[h, :, j].reshape(d)  # in every subspace along centroid j: tops its lists
    plain = 0.01 * torch.ones(kvh, 1, d)
    qd = cent[:, :, j].reshape(kvh, 1, 1, d).expand(kvh, 2, 1, d).contiguous()  # group queries = centroid j

    a = get_method("csattn").open(_reader(arr), p, n)
    b = get_method("csattn").open(_reader(arr), p, n)
    pos = torch.tensor([n])  # both requests append their own token at the same position
    a.append(0, star, star, pos)
    b.append(0, plain, plain, pos)
    loc = {"a": star, "b": plain}
    kv = {r: KVView(k[0], v[0], torch.cat([loc[r], torch.randn(kvh, 1, d)], 1), v[0, :, :2], torch.tensor([n + 1]))
          for r in loc}
    sel_a, sel_b = a.select(0, qd, kv["a"]), b.select(0, qd, kv["b"])
    assert n in sel_a[h, 0].tolist(), "the appended best match is selected"
    assert n not in sel_b[h, 0].tolist(), "another request's key leaked into this one"
    idx_a, _ = a.lists(0)
    idx_b, _ = b.lists(0)
    assert (idx_a[h, :, j, 0] == n).all()
    assert not (idx_b[h, :, j] == n).any()
    for name in arr:
        assert torch.equal(arr[name], before[name]), f"persisted {name} was modified"
    fresh_idx, _ = get_method("csattn").open(_reader(arr), p, n).lists(0)
    assert torch.equal(fresh_idx, arr["idx"][0].long())


def test_effective_lists_tie_keeps_older():
    idx = torch.tensor([[10, 11, 12]])
    score = torch.tensor([[3.0, 2.0, 1.0]])
    i, s, low = effective_lists(idx, score, torch.tensor([[1.0, 2.5]]), torch.tensor([20, 21]))
    assert i.tolist() == [[10, 21, 11]] and s.tolist() == [[3.0, 2.5, 2.0]] and low.tolist() == [[2.0]]
    i, s, low = effective_lists(idx, score, torch.tensor([[9.0]]), torch.tensor([30]))  # new best: moves first
    assert i.tolist() == [[30, 10, 11]] and s.tolist() == [[9.0, 3.0, 2.0]] and low.tolist() == [[2.0]]
    i, _, low = effective_lists(idx, score, torch.tensor([[9.0]]), torch.tensor([30]), sort=False)
    assert sorted(i.tolist()[0]) == [10, 11, 30] and low.tolist() == [[2.0]]


def test_search_period_reuses_selection(small_index, monkeypatch):
    import indexer.csattn as cs

    arr, _, (k, v) = small_index
    n, kvh, d = k.shape[2], k.shape[1], k.shape[3]
    p = CSAttnParams(m=4, n_centroids=8, list_len=32, schedule="0.20-step-8", sink=0, window=0)
    assert (p.keep_ratio, p.search_period) == (0.20, 8)
    calls = []
    real = cs.search
    monkeypatch.setattr(cs, "search", lambda *a, **kw: calls.append(a[3].shape[2]) or real(*a, **kw))
    sess = get_method("csattn").open(_reader(arr), p, n)
    sels = []
    for step, t in enumerate([4] + [1] * 10):  # a question chunk, then one-token steps
        pos = n + step * 1 + (3 if step else 0)
        qd = torch.randn(kvh, 2, t, d)
        kv = KVView(k[0], v[0], k[0, :, : pos - n + 1], v[0, :, : pos - n + 1], torch.arange(pos - t + 1, pos + 1))
        sels.append(sess.select(0, qd, kv))
        sess.append(0, kv.loc_k[:, -t:], kv.loc_v[:, -t:], kv.q_pos)
    # the chunk searches; one-token steps search every 8th step and reuse in between
    assert calls == [4, 1, 1]
    assert all(sels[i] is sels[1] for i in range(2, 9)) and sels[9] is not sels[1]
    assert sels[1].shape[-1] == math.ceil(0.2 * (n + 5))


# ---------------------------------------------------------------------------------------------
# CPU<->GPU overlap (mode="offload"): background updates, one-step lookahead, worker life cycle.
# A CPU "device": the query is on the CPU, so the frame's attention is the decoder's, but the
# worker thread, its ordering and the lookahead are the same code as with a GPU.


def _csattn_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("csattn-host") and t.is_alive()}


def _decode_script(n, kvh, g, d, steps, seed):
    """A question chunk (T=3) then one-token steps: (queries [KVH, G, T, D], appended keys, KVView)."""
    gen = torch.Generator().manual_seed(seed)
    loc = 3 * torch.randn(kvh, 3 + steps, d, generator=gen)
    out, m = [], 0
    for t in [3] + [1] * steps:
        m += t
        q = torch.randn(kvh, g, t, d, generator=gen)
        kv = KVView(torch.zeros(kvh, n, d), torch.zeros(kvh, n, d), loc[:, :m], loc[:, :m], torch.arange(n + m - t, n + m))
        out.append((q, kv))
    return out


@pytest.mark.parametrize("schedule", [None, "0.15-step-4"])
def test_lookahead_is_the_sync_search_with_the_previous_query(small_index, monkeypatch, schedule):
    """overlap='lookahead' selects at step t exactly what the synchronous path selects when given
    step t-1's query (the question chunk, T > 1, searches synchronously with its own); the search
    runs on the session's worker threads (3 layers on 2 workers); overlap='updates' selects what
    'off' does (exact)."""
    import indexer.csattn as cs

    arr, p, (k, v) = small_index
    n, kvh, d = k.shape[2], k.shape[1], k.shape[3]
    arr = {name: torch.cat([t] * 3) for name, t in arr.items()}  # 3 layers (same tables)
    base = {"m": 4, "n_centroids": 8, "list_len": 32, "sink": 0, "window": 4, "mode": "offload", "host_workers": 2}
    if schedule:
        base["schedule"] = schedule
    else:
        base["k"] = 6
    where = []
    real = cs.search
    monkeypatch.setattr(cs, "search", lambda *a, **kw: where.append(threading.current_thread().name) or real(*a, **kw))

    def open_(overlap):
        return get_method("csattn").open(_reader(arr), CSAttnParams(**base, overlap=overlap), n)

    la, up, s_prev, s_cur = open_("lookahead"), open_("updates"), open_("off"), open_("off")
    prev = {}
    for step, (q, kv) in enumerate(_decode_script(n, kvh, 2, d, steps=10, seed=13)):
        for layer in (0, 1, 2):
            q_prev = prev.get(layer, q)
            got = {"la": la.select(layer, q, kv), "up": up.select(layer, q, kv),
                   "prev": s_prev.select(layer, q_prev, kv), "cur": s_cur.select(layer, q, kv)}
            assert torch.equal(got["la"], got["prev"]), step
            assert torch.equal(got["up"], got["cur"]), step
            prev[layer] = q[:, :, -1:]
            for s in (la, up, s_prev, s_cur):
                s.append(layer, kv.loc_k[:, -q.shape[2]:], kv.loc_v[:, -q.shape[2]:], kv.q_pos)
    # the chunk searched on the caller's thread; each one-token search step (and the step after
    # the last, planned ahead) on the worker
    for layer in (0, 1, 2):
        la.lists(layer)  # waits for the workers
    period = CSAttnParams(**base).search_period
    workers = [w for w in where if w.startswith("csattn-host")]
    assert len(workers) == 3 * len([s for s in range(1, 12) if (s - 1) % period == 0]), where
    assert len(set(workers)) == 2 and len(la._pools) == 2
    assert la._pools and up._pools and not s_prev._pools
    for s in (la, up):
        s.close()


def test_background_update_is_found_by_the_next_search_and_sessions_are_isolated(small_index):
    """A key appended at step t that tops centroid j's lists is selected at step t+1, where that
    step's selection was planned on the worker (lookahead) after the update ran there; another
    request appending at the same position sees none of it; the persisted tables are untouched."""
    arr, p, (k, v) = small_index
    n, kvh, d = k.shape[2], k.shape[1], k.shape[3]
    before = {name: t.clone() for name, t in arr.items()}
    cent = arr["centroids"][0].float()
    h, j = 1, 3
    star = torch.zeros(kvh, 1, d)
    star[h, 0] = 50 * cent[h, :, j].reshape(d)
    plain = 0.01 * torch.ones(kvh, 1, d)
    qd = cent[:, :, j].reshape(kvh, 1, 1, d).expand(kvh, 2, 1, d).contiguous()
    po = CSAttnParams(m=4, n_centroids=8, list_len=32, k=4, sink=0, window=0, mode="offload", overlap="lookahead")
    a, b = (get_method("csattn").open(_reader(arr), po, n) for _ in range(2))
    sels = {}
    for name, s, new in (("a", a, star), ("b", b, plain)):
        kv0 = KVView(k[0], v[0], torch.randn(kvh, 1, d), v[0, :, :1], torch.tensor([n]))
        s.select(0, qd, kv0)  # step 0: synchronous
        s.append(0, new, new, torch.tensor([n]))  # update + plan of step 1, both on the worker
        kv1 = KVView(k[0], v[0], torch.cat([new, torch.randn(kvh, 1, d)], 1), v[0, :, :2], torch.tensor([n + 1]))
        assert 0 in s._next, "step 1 was planned ahead"
        sels[name] = s.select(0, qd, kv1)
        assert 0 not in s._next and s._last[0][1] == 0
    assert n in sels["a"][h, 0].tolist(), "the appended best match is selected"
    assert n not in sels["b"][h, 0].tolist(), "another request's key leaked into this one"
    assert a._pools[0] is not b._pools[0]
    idx_a, _ = a.lists(0)
    assert (idx_a[h, :, j, 0] == n).all()
    for name in arr:
        assert torch.equal(arr[name], before[name]), f"persisted {name} was modified"
    a.close()
    b.close()


def test_worker_threads_end_on_close_and_on_collection(small_index):
    import gc

    arr, p, (k, v) = small_index
    n, kvh, d = k.shape[2], k.shape[1], k.shape[3]
    po = CSAttnParams(m=4, n_centroids=8, list_len=32, k=4, sink=0, window=0, mode="offload", overlap="lookahead",
                      host_workers=2)
    before = _csattn_threads()
    script = _decode_script(n, kvh, 2, d, steps=5, seed=5)

    def use(s, steps=slice(0, 4)):
        for q, kv in script[steps]:
            s.select(0, q, kv)
            s.append(0, kv.loc_k[:, -q.shape[2]:], kv.loc_v[:, -q.shape[2]:], kv.q_pos)

    a, b = (get_method("csattn").open(_reader(arr), po, n) for _ in range(2))
    use(a)
    use(b)
    mine = _csattn_threads() - before
    assert len(mine) == 4, "host_workers per session"
    a.close()
    a.close()  # idempotent
    assert len(_csattn_threads() - before) == 2
    use(a, slice(4, 6))  # a closed session still works (a new worker)
    a.close()
    del b  # dropped without close(): its worker ends once the session is collected
    gc.collect()
    for _ in range(50):
        if not (_csattn_threads() - before):
            break
        time.sleep(0.1)
    assert not (_csattn_threads() - before), "leaked csattn worker threads"
    # the default in offload mode, 'updates': one worker; overlap off: no thread at all
    s = get_method("csattn").open(_reader(arr), po.with_overrides({"overlap": None}), n)
    use(s)
    assert s.overlap == "updates" and len(s._pools) == 1
    s.close()
    s = get_method("csattn").open(_reader(arr), po.with_overrides({"overlap": "off"}), n)
    use(s)
    assert not s._pools and not (_csattn_threads() - before)


def test_params_validation():
    with pytest.raises(ValidationError):
        CSAttnParams(alpha=0)
    with pytest.raises(ValidationError):
        CSAttnParams(rho=1.5)
    with pytest.raises(ValidationError):
        CSAttnParams(schedule="0.3-step-2")
    with pytest.raises(ValidationError):
        CSAttnParams(unknown=1)
    with pytest.raises(ValidationError):
        CSAttnParams(tau=0)
    for mode, overlap in (("gpu", "lookahead"), ("auto", "updates")):  # overlap is for the host search only
        with pytest.raises(ValidationError, match="needs mode='offload'"):
            CSAttnParams(mode=mode, overlap=overlap)
    with pytest.raises(ValidationError):
        CSAttnParams(mode="offload", overlap="lookahead", host_workers=0)
    assert [CSAttnParams(mode=mo).overlap_level for mo in ("auto", "gpu", "offload")] == ["off", "off", "updates"]
    assert CSAttnParams(mode="gpu", overlap="off").overlap_level == "off"
    p = CSAttnParams(schedule="0.15-step-4").with_overrides({"rho": 0.1})
    assert (p.keep_ratio, p.search_period) == (0.1, 4)
    assert CSAttnParams().build_params() == {"m": 8, "n_centroids": 64, "alpha": 0.2, "list_len": None,
                                             "min_list_len": 256, "iterations": 10, "seed": 0,
                                             "train_queries": 32768}
    # alpha * N with a floor for short contexts, never more than N
    assert [CSAttnParams().list_size(n) for n in (100, 560, 2048)] == [100, 256, 410]
    method = get_method("csattn")
    assert method.index_id(CSAttnParams(rho=0.2)) == method.index_id(CSAttnParams())
    assert method.index_id(CSAttnParams(m=4)) != method.index_id(CSAttnParams())
    spec = type("Spec", (), {"head_dim": 64, "num_heads": 9, "num_kv_heads": 3})()
    assert method.validate_configuration(spec, CSAttnParams(m=6)) != []
    assert method.validate_configuration(spec, CSAttnParams(m=16)) == []


# ---------------------------------------------------------------------------------------------
# GPU (skipped on CPU CI with a reason, see conftest.py)


@pytest.mark.gpu
def test_gpu_matches_cpu_all_gpu_and_offload():
    """Same tables, same query: the GPU search selects the CPU's set (>= 99% overlap: float
    summation order can flip exact near-ties); CPU<->GPU (offload: host search, only the selected
    K/V rows shipped) equals All-GPU attention over the same selection to 1e-2 relative L2 (bf16).
    A GPU build is checked for self-consistency and k-means quality vs the CPU build (the k-means++
    draws are the same, but float rounding can move a draw, so centroids are not compared 1:1)."""
    n, kvh, g, d = 4096, 4, 4, 128
    q, k, v = _synthetic(n, kvh, g, d, seed=21)
    p = CSAttnParams(sink=4, window=32)
    tables = build_layer(q[0], k[0], p, torch.Generator().manual_seed(0))
    arr = {name: t[None] for name, t in zip(("centroids", "idx", "score"), tables)}

    gt = build_layer(q[0].cuda(), k[0].cuda(), p, torch.Generator().manual_seed(0))
    assert all(t.is_cuda for t in gt)
    c_gpu = gt[0].float().cpu()
    ref = torch.einsum("hmcd,hmdn->hmcn", c_gpu, k[0].reshape(kvh, n, 8, 16).permute(0, 2, 3, 1))
    assert torch.allclose(gt[2].float().cpu(), ref.topk(gt[2].shape[-1], dim=-1).values, atol=2e-2)

    def kmeans_fit(cent):  # mean best cosine of the training sub-queries
        x = torch.nn.functional.normalize(q[0].reshape(kvh, g * n, 8, 16).permute(0, 2, 1, 3), dim=-1)
        return float(torch.einsum("hmnd,hmcd->hmnc", x, cent.float()).max(-1).values.mean())

    fit_c, fit_g = kmeans_fit(tables[0]), kmeans_fit(c_gpu)
    print(f"\nk-means fit (mean best cosine): cpu {fit_c:.4f} gpu {fit_g:.4f}")
    assert abs(fit_c - fit_g) < 0.01

    qb = torch.randn(kvh, g, 1, d).bfloat16()  # every path sees the same (bf16-exact) query values
    loc = torch.randn(kvh, 3, d).bfloat16().float()
    qpos = torch.tensor([n + 2])
    cpu = get_method("csattn").open(_reader(arr), p, n)
    gpu = get_method("csattn").open(_reader(arr), p.with_overrides({"mode": "gpu"}), n)
    off = get_method("csattn").open(_reader(arr), p.with_overrides({"mode": "offload"}), n)
    for s, dev in ((cpu, "cpu"), (gpu, "cuda"), (off, "cuda")):
        s.append(0, loc[:, :2].to(dev), loc[:, :2].to(dev), torch.tensor([n, n + 1], device=dev))
    sel_c = cpu.select(0, qb.float(), KVView(k[0], v[0], loc, loc, qpos))
    kv_g = KVView(k[0].cuda(), v[0].cuda(), loc.cuda(), loc.cuda(), qpos.cuda())
    sel_g = gpu.select(0, qb.float().cuda(), kv_g)
    assert sel_g.is_cuda and gpu.tables(0, "cuda")[1].is_cuda
    overlap = (sel_g.cpu()[..., :, None] == sel_c[..., None, :]).any(-1).float().mean()
    print(f"GPU vs CPU selection overlap: {float(overlap):.5f}")
    assert float(overlap) >= 0.99

    bf = torch.bfloat16
    idx = merge_selection(sel_c.cuda(), kv_g.q_pos, p.sink, p.window)
    out_g = sparse_attention(qb.cuda(), idx, kv_g.ctx_k.to(bf), kv_g.ctx_v.to(bf), kv_g.loc_k.to(bf),
                             kv_g.loc_v.to(bf), d ** -0.5)
    kv_o = KVView(k[0].to(bf), v[0].to(bf), loc.cuda().to(bf), loc.cuda().to(bf), qpos.cuda())
    out_o, frac = off.attend(0, qb.cuda(), kv_o)  # context K/V on the host, query on the GPU
    assert out_o.is_cuda and frac.shape == (kvh, 1)
    rel = (out_o.float() - out_g.float()).norm() / out_g.float().norm()
    print(f"offload vs All-GPU attention rel L2: {float(rel):.2e}")
    assert float(rel) < 1e-2


@pytest.mark.gpu
def test_gpu_offload_lookahead_matches_sync():
    """CPU<->GPU with CUDA queries and host tables/K/V: the lookahead path (plan, host gather and
    H2D copy on the worker, side stream + event) attends over the selection a synchronous search
    with the previous step's query makes (>= 99% overlap, as GPU vs CPU above; measured: equal), and
    its output equals the synchronous offload path given that selection (rel L2 <= 1e-3; same
    kernels over the same rows: a copy the compute stream did not wait for would show)."""
    n, kvh, g, d = 4096, 4, 4, 128
    q, k, v = _synthetic(n, kvh, g, d, seed=23)
    p = CSAttnParams(sink=4, window=32, mode="offload")
    tables = build_layer(q[0], k[0], p, torch.Generator().manual_seed(0))
    arr = {name: t[None] for name, t in zip(("centroids", "idx", "score"), tables)}
    la, sync, forced = (get_method("csattn").open(_reader(arr), p.with_overrides({"overlap": o}), n)
                        for o in ("lookahead", "off", "off"))
    bf = torch.bfloat16
    ctx_k, ctx_v = k[0].to(bf), v[0].to(bf)  # host
    loc = torch.randn(kvh, 8, d, device="cuda").to(bf)
    prev, worst_overlap, worst_rel = None, 1.0, 0.0
    for step in range(6):
        qpos = torch.tensor([n + step], device="cuda")
        kv = KVView(ctx_k, ctx_v, loc[:, :step + 1], loc[:, :step + 1], qpos)
        qq = torch.randn(kvh, g, 1, d, device="cuda").to(bf)
        out, _ = la.attend(0, qq, kv)
        sel = la._last[0][0]
        want = sync.select(0, qq if prev is None else prev, kv).cpu()
        worst_overlap = min(worst_overlap, float((sel[..., :, None] == want[..., None, :]).any(-1).float().mean()))
        forced._plan = lambda layer, q, kv, ship, sel=sel: (sel, None)
        ref, _ = forced.attend(0, qq, kv)
        worst_rel = max(worst_rel, float((out.float() - ref.float()).norm() / ref.float().norm()))
        for s in (la, sync):
            s.append(0, loc[:, step:step + 1], loc[:, step:step + 1], qpos)
        prev = qq
    la.close()
    print(f"\nlookahead vs sync search with the previous query: overlap min {worst_overlap:.5f}; "
          f"output vs offload-sync over the same selection: rel L2 max {worst_rel:.2e}")
    assert worst_overlap >= 0.99
    assert worst_rel <= 1e-3
