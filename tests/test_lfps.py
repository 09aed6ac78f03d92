"""LFPS (indexer/lfps.py): brute-force references on hand-made tables, the update rule, the bypass,
recall on real captured Q/K, per-request isolation. Float tolerances: atol 1e-5, rtol 1e-4 (fp32)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from decoder.attention import merge_selection, sparse_attention
from decoder.fidelity import build_index, selection_recall, truncate_capture
from indexer.base import IndexReader, KVView, PrefillCapture, get_method
from indexer.lfps import expand_candidates, init_tables, initial_candidates, mask_to_index

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL, RTOL = 1e-5, 1e-4


def _reader(arrays):
    return IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))


def _hand_index(vert, slash, kvh=1, g=2, d=8):
    """Single-layer index with hand-made tables; mean K/V zero, var_ratio zero."""
    return {
        "vertical": vert[None, None].float().expand(1, kvh, -1).clone(),
        "slash": slash[None, None].float().expand(1, kvh, -1).clone(),
        "mean_k": torch.zeros(1, kvh, d), "mean_v": torch.zeros(1, kvh, d), "var_ratio": torch.zeros(1, kvh * g),
    }


def _kv(kvh=1, g=2, n=200, m=1, t=1, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(kvh, g, t, d, generator=gen)
    ck, cv = torch.randn(kvh, n, d, generator=gen), torch.randn(kvh, n, d, generator=gen)
    lk, lv = torch.randn(kvh, m, d, generator=gen), torch.randn(kvh, m, d, generator=gen)
    return q, KVView(ck, cv, lk, lv, torch.arange(n + m - t, n + m))


def test_params_are_validated():
    P = get_method("lfps").Params
    for bad in ({"lam": 0.05}, {"lam": 0.5}, {"gamma": 1.0}, {"gamma": 0.0}, {"bypass_threshold": 0.0},
                {"bypass_threshold": 1.5}, {"ratio": 0.0}, {"init_steps": 0}, {"local": 0}, {"nope": 1}):
        with pytest.raises(ValidationError):
            P(**bad)
    p = P()
    assert (p.gamma, p.lam, p.bypass_threshold) == (0.95, 0.2, 0.85)
    assert set(p.build_params()) == {"init_steps", "table_sink", "gamma"}


def test_init_tables_match_a_loop():
    gen = torch.Generator().manual_seed(0)
    g, n, d, r, gamma, ts = 2, 12, 4, 5, 0.9, 2
    q, k = torch.randn(g, n, d, generator=gen), torch.randn(n, d, generator=gen)
    vert, slash = init_tables(q, k, r, gamma, ts)
    v_ref, s_ref = [0.0] * n, [0.0] * n
    for i in range(r):
        p = n - r + i
        w = [0.0] * n
        for h in range(g):
            logits = [float(q[h, p] @ k[j]) / math.sqrt(d) for j in range(p + 1)]
            mx = max(logits)
            e = [math.exp(x - mx) for x in logits]
            for j in range(p + 1):
                w[j] += e[j] / sum(e) / g
        tot = sum(w[ts:])
        c = 0.5 * gamma ** (r - 1 - i) / (1 - gamma ** r)
        for j in range(ts, p + 1):
            v_ref[j] += c * w[j] / tot
            s_ref[p - j] += c * w[j] / tot
    torch.testing.assert_close(vert, torch.tensor(v_ref), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(slash, torch.tensor(s_ref), atol=ATOL, rtol=RTOL)
    # the initial tables carry the stationary mass of the decode update, 0.5 / (1 - gamma)
    assert abs(float(vert.sum()) - 0.5 / (1 - gamma)) < 1e-4 and abs(float(slash.sum()) - 0.5 / (1 - gamma)) < 1e-4


def _brute_candidates(v, s_at, valid, lam):
    """Plain-Python reference of steps 2-3 for one row."""
    def stats(x):
        xs = [x[j] for j in range(len(x)) if valid[j]]
        mu = sum(xs) / len(xs)
        var = sum((a - mu) ** 2 for a in xs) / len(xs)
        if var == 0:
            return math.inf, mu
        kurt = sum((a - mu) ** 4 for a in xs) / len(xs) / var ** 2
        return mu + lam * (max(xs) - mu) * math.sqrt(3 / kurt), mu
    tv, mv = stats(v)
    ts, ms = stats(s_at)
    c0 = {j for j in range(len(v)) if valid[j] and (v[j] > tv or s_at[j] > ts)}
    keep = {j for j in range(len(v)) if valid[j] and (v[j] > mv or s_at[j] > ms)}
    return c0, {j + dd for j in c0 for dd in (-1, 0, 1, 2)} & keep


@pytest.mark.parametrize("lam", [0.1, 0.25, 0.4])
def test_candidates_match_a_brute_force_reference(lam):
    gen = torch.Generator().manual_seed(int(lam * 100))
    p = 300
    v = (torch.distributions.Exponential(1.0).sample((2, p)) ** 3).double()  # heavy tailed, like real tables
    s_at = (torch.rand(2, p, generator=gen).double() ** 8) * 10
    valid = torch.ones(2, p, dtype=torch.bool)
    valid[:, :4] = False
    valid[1, 250:] = False
    c0, keep = initial_candidates(v, s_at, valid, lam)
    e = expand_candidates(c0, keep)
    for row in range(2):
        ref_c0, ref_e = _brute_candidates(v[row].tolist(), s_at[row].tolist(), valid[row].tolist(), lam)
        assert set(c0[row].nonzero().flatten().tolist()) == ref_c0
        assert set(e[row].nonzero().flatten().tolist()) == ref_e
        assert ref_c0 <= ref_e  # tau >= mean: every initial candidate survives at offset 0
    # larger lam -> higher threshold -> fewer initial candidates
    sizes = [int(initial_candidates(v, s_at, valid, lam_)[0].sum()) for lam_ in (0.1, 0.2, 0.3, 0.4)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_expansion_offsets_exactly():
    c0 = torch.zeros(20, dtype=torch.bool)
    c0[[0, 10, 19]] = True
    keep = torch.ones(20, dtype=torch.bool)
    assert expand_candidates(c0, keep).nonzero().flatten().tolist() == [0, 1, 2, 9, 10, 11, 12, 18, 19]
    keep[11] = False
    assert expand_candidates(c0, keep).nonzero().flatten().tolist() == [0, 1, 2, 9, 10, 12, 18, 19]


def test_mask_to_index():
    m = torch.tensor([[True, False, True, True], [False, False, False, True], [False] * 4])
    assert mask_to_index(m).tolist() == [[0, 2, 3], [3, -1, -1], [-1, -1, -1]]


def _hand_tables(n=200):
    vert = torch.zeros(n)
    vert[100] = 100.0
    vert[[97, 98, 99, 101, 102, 103, 104]] = 1.0  # above the mean, under the threshold
    slash = torch.zeros(n)
    slash[50] = 100.0  # offset 50 from the query at 200 -> position 150
    slash[[48, 49, 51, 52]] = 1.0  # positions 152, 151, 149, 148
    return vert, slash


def test_session_candidates_on_hand_made_tables():
    arrays = _hand_index(*_hand_tables())
    before = {k: v.clone() for k, v in arrays.items()}
    lfps = get_method("lfps")
    params = lfps.Params(sink=4, window=8, bypass=False, lam=0.2, k=3)
    s = lfps.open(_reader(arrays), params, 200)
    q, kv = _kv()  # query at position 200
    assert s.attend(0, q, kv) is None  # no bypass: the frame attends over the selection
    sel = s.select(0, q, kv)
    cand = s.last[0].candidates[0, 0]
    cand = set(cand[cand >= 0].tolist())
    sink, window = set(range(4)), set(range(193, 201))
    # C0 = {100 (vertical), 150 (slash)}; expansion by {-1, 0, +1, +2} filtered by "above the mean";
    # 97, 98, 103, 104, 148 are above the mean but are no offset of a C0 member
    assert cand == sink | window | {99, 100, 101, 102} | {149, 150, 151, 152}
    chosen = set(sel[0, 0][sel[0, 0] >= 0].tolist())
    assert len(chosen) == 3 and chosen <= {99, 100, 101, 102, 149, 150, 151, 152}  # top-K among the non-fixed
    for k, v in arrays.items():
        assert torch.equal(v, before[k]), f"persisted {k} was written"


def _attended_weights(q, kv, positions, sink):
    """Reference update weights: per head softmax over the attended set, sink removed, renormalised,
    mean over the group; returned as a dense vector over positions."""
    n = kv.n_ctx
    k_all = torch.cat([kv.ctx_k, kv.loc_k], 1)[0]
    pos = torch.tensor(sorted(positions))
    s = torch.einsum("gd,pd->gp", q[0, :, 0], k_all[pos]) * q.shape[-1] ** -0.5
    w = torch.softmax(s, -1)
    w[:, pos < sink] = 0
    w = (w / w.sum(-1, keepdim=True)).mean(0)
    dense = torch.zeros(n + kv.n_local)
    dense[pos] = w
    return dense


def test_table_update_rule():
    vert0, slash0 = _hand_tables()
    arrays = _hand_index(vert0, slash0)
    lfps = get_method("lfps")
    params = lfps.Params(sink=4, window=8, bypass=False, k=3)
    s = lfps.open(_reader(arrays), params, 200)
    q, kv = _kv()
    s.attend(0, q, kv)
    sel = s.select(0, q, kv)
    attended = set(range(4)) | set(range(193, 201)) | set(sel[0, 0][sel[0, 0] >= 0].tolist())
    w = _attended_weights(q, kv, attended, 4)  # [201]
    vert, slash = s._tables[0]
    g = params.gamma
    torch.testing.assert_close(vert[0, :201], g * torch.cat([vert0, torch.zeros(1)]) + 0.5 * w, atol=ATOL, rtol=RTOL)
    slash_ref = g * torch.cat([slash0, torch.zeros(1)])
    slash_ref += 0.5 * torch.flip(w, [0])  # offset o = 200 - j
    torch.testing.assert_close(slash[0, :201], slash_ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(arrays["vertical"][0, 0], vert0) and torch.equal(arrays["slash"][0, 0], slash0)


@pytest.mark.parametrize("dense_prompt", [True, False])
def test_multi_token_step_decays_once_per_token(dense_prompt):
    vert0, slash0 = _hand_tables()
    arrays = _hand_index(vert0, slash0)
    lfps = get_method("lfps")
    s = lfps.open(_reader(arrays), lfps.Params(sink=4, window=8, bypass=False, dense_prompt=dense_prompt), 200)
    q, kv = _kv(m=6, t=6)  # 6 query tokens at 200..205
    assert s.attend(0, q, kv) is None
    sel = s.select(0, q, kv)
    g, t = 0.95, 6
    vert, slash = s._tables[0]
    if dense_prompt:  # dense attention, and the exact weights of each token enter the tables in order
        assert sel is None
        v_ref = torch.cat([vert0, torch.zeros(6)])
        s_ref = torch.cat([slash0, torch.zeros(6)])
        for i in range(t):
            p = 200 + i
            qi = KVView(kv.ctx_k, kv.ctx_v, kv.loc_k, kv.loc_v, kv.q_pos[i:i + 1])
            w = _attended_weights(q[:, :, i:i + 1], qi, set(range(p + 1)), 4)
            v_ref = g * v_ref + 0.5 * w
            s_ref = g * s_ref
            s_ref[:p + 1] += 0.5 * torch.flip(w[:p + 1], [0])
        torch.testing.assert_close(vert[0, :206], v_ref, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(slash[0, :206], s_ref, atol=ATOL, rtol=RTOL)
    else:  # planned from the tables, one selection per token
        assert sel.shape[:2] == (1, 6)
    want = g ** t * float(vert0.sum()) + 0.5 * (1 - g ** t) / (1 - g)  # each token adds mass 0.5
    assert abs(float(vert.sum()) - want) < 1e-3
    assert abs(float(slash.sum()) - (g ** t * float(slash0.sum()) + 0.5 * (1 - g ** t) / (1 - g))) < 1e-3


def test_bypass_for_highly_sparse_heads():
    d, n = 8, 200
    vert0, slash0 = _hand_tables()
    arrays = _hand_index(vert0, slash0, d=d)
    gen = torch.Generator().manual_seed(2)
    arrays["mean_k"] = torch.randn(1, 1, d, generator=gen) * 0.1
    arrays["mean_v"] = torch.randn(1, 1, d, generator=gen)
    arrays["var_ratio"] = torch.full((1, 2), 0.5)
    q, kv = _kv(d=d)
    e1 = torch.zeros(d)
    e1[0] = 1.0
    kv.ctx_k[0, 0] = 12 * e1  # the sink key
    q[0, 0, 0] = 6 * e1  # head 0: logit 72/sqrt(8) on the sink -> highly sparse
    q[0, 1, 0] = -6 * e1  # head 1: the sink is irrelevant
    lfps = get_method("lfps")
    params = lfps.Params(sink=4, window=8, k=3)
    s = lfps.open(_reader(arrays), params, n)
    out, frac = s.attend(0, q, kv)
    plan = s.last[0]
    assert plan.bypass[0, :, 0].tolist() == [True, False]
    assert plan.sparsity[0, 0, 0] > 0.99 and plan.sparsity[0, 1, 0] < 0.5
    scale = d ** -0.5
    k_all, v_all = torch.cat([kv.ctx_k, kv.loc_k], 1)[0], torch.cat([kv.ctx_v, kv.loc_v], 1)[0]
    fixed = torch.tensor(list(range(4)) + list(range(193, 201)))
    # head 0: sink + window exact, plus the mean value weighted by n_rest·exp(mu + sigma^2 / 2)
    qq = q[0, 0, 0]
    s_fixed = k_all[fixed] @ qq * scale
    mu = float(arrays["mean_k"][0, 0] @ qq) * scale
    sig2 = 0.5 * float(qq @ qq) * scale ** 2
    log_w = torch.cat([s_fixed, torch.tensor([math.log(201 - 12) + mu + sig2 / 2])])
    p = torch.softmax(log_w, 0)
    ref0 = p[:-1] @ v_all[fixed] + p[-1] * arrays["mean_v"][0, 0]
    torch.testing.assert_close(out[0, 0, 0], ref0, atol=ATOL, rtol=RTOL)
    # head 1: exact attention over sink + window + the selection (what the frame would compute)
    idx = merge_selection(plan.sel, kv.q_pos, 4, 8)
    ref1 = sparse_attention(q, idx, kv.ctx_k, kv.ctx_v, kv.loc_k, kv.loc_v, scale)[0, 1]
    torch.testing.assert_close(out[0, 1], ref1, atol=ATOL, rtol=RTOL)
    assert abs(float(frac[0, 0]) - float((idx >= 0).sum()) / 201) < 1e-6
    # only the searching head updates the tables
    attended = set(idx[0, 0][idx[0, 0] >= 0].tolist())
    k1 = KVView(kv.ctx_k, kv.ctx_v, kv.loc_k, kv.loc_v, kv.q_pos)
    w = _attended_weights(q[:, 1:2], k1, attended, 4)
    torch.testing.assert_close(s._tables[0][0][0, :201], 0.95 * torch.cat([vert0, torch.zeros(1)]) + 0.5 * w,
                               atol=ATOL, rtol=RTOL)
    # every head bypassed: no search, no update
    q[0, 1, 0] = 6 * e1
    s2 = lfps.open(_reader(arrays), params, n)
    out2, frac2 = s2.attend(0, q, kv)
    assert s2.last[0].bypass.all() and 0 not in s2._tables
    assert abs(float(frac2[0, 0]) - 13 / 201) < 1e-6  # sink + window + the mean pseudo-token


def _random_index(n=300, kvh=2, g=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cap = PrefillCapture(q=torch.randn(1, kvh * g, n, d, generator=gen), k=torch.randn(1, kvh, n, d, generator=gen),
                         v=torch.randn(1, kvh, n, d, generator=gen), positions=torch.arange(n), spec=None)
    lfps = get_method("lfps")
    params = lfps.Params(sink=4, window=8)
    return lfps, params, cap, lfps.build(cap, params)


def test_build_shapes():
    _, params, cap, arrays = _random_index()
    assert arrays["vertical"].shape == (1, 2, 300) and arrays["slash"].shape == (1, 2, 300)
    assert arrays["mean_k"].shape == (1, 2, 8) and arrays["var_ratio"].shape == (1, 4)
    torch.testing.assert_close(arrays["mean_v"][0], cap.v[0, :, 4:].mean(1))
    assert (arrays["vertical"][..., :4] == 0).all()  # sinks are kept out of the tables


def test_sessions_are_isolated_and_index_is_never_written():
    lfps, params, cap, arrays = _random_index()
    before = {k: v.clone() for k, v in arrays.items()}
    reader = _reader(arrays)
    a, b = lfps.open(reader, params, 300), lfps.open(reader, params, 300)
    gen = torch.Generator().manual_seed(4)
    loc_k, loc_v = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    for i in range(5):  # a decodes 5 tokens
        q = torch.randn(2, 2, 1, 8, generator=gen)
        kv = KVView(cap.k[0], cap.v[0], loc_k[:, :i + 1], loc_v[:, :i + 1], torch.tensor([300 + i]))
        if a.attend(0, q, kv) is None:
            a.select(0, q, kv)
    kv = KVView(cap.k[0], cap.v[0], loc_k[:, :1], loc_v[:, :1], torch.tensor([300]))
    q = torch.randn(2, 2, 1, 8, generator=gen)
    fresh = lfps.open(reader, params, 300)
    for sess in (b, fresh):
        if sess.attend(0, q, kv) is None:
            sess.select(0, q, kv)
    assert torch.equal(b.last[0].candidates, fresh.last[0].candidates)  # b did not see a's updates
    assert torch.equal(b._tables[0][0], fresh._tables[0][0])
    assert not torch.equal(a._tables[0][0][:, :300], b._tables[0][0][:, :300])
    for k, v in arrays.items():
        assert torch.equal(v, before[k]), f"persisted {k} was written"


# ---------------------------------------------------------------------------------------------
# real captured Q/K


LAYERS = [2, 9, 16, 23, 29]


@pytest.mark.slow
def test_recall_on_real_captured_qk(captured_2k):
    lfps, topk = get_method("lfps"), get_method("topk")
    rows = {}
    n_ctx = captured_2k.n_tokens - 8
    for ratio in (0.05, 0.10):
        for bypass in (False, True):
            p = lfps.Params(ratio=ratio, bypass=bypass)
            rows[(ratio, bypass)] = selection_recall(lfps, p, captured_2k, n_queries=8, ratio=ratio,
                                                     layers=LAYERS).summary()
        rows[("topk", ratio)] = selection_recall(topk, topk.Params(ratio=ratio), captured_2k, n_queries=8, ratio=ratio,
                                                 layers=LAYERS).summary()
    # candidate fraction: replay the same queries once more, reading the session's stats
    p = lfps.Params()
    sess = lfps.open(build_index(lfps, p, truncate_capture(captured_2k, n_ctx)), p, n_ctx)
    spec = captured_2k.spec
    for layer in LAYERS:
        for i in range(8):
            pos = n_ctx + i
            q = captured_2k.q[layer, :, pos:pos + 1].reshape(spec.num_kv_heads, spec.group_size, 1, spec.head_dim)
            k, v = captured_2k.k[layer], captured_2k.v[layer]
            kv = KVView(k[:, :n_ctx], v[:, :n_ctx], k[:, n_ctx:pos + 1], v[:, n_ctx:pos + 1], torch.tensor([pos]))
            if sess.attend(layer, q, kv) is None:
                sess.select(layer, q, kv)
    st = sess.stats()
    for key, s in rows.items():
        print(key, {k: round(v, 3) for k, v in s.items() if isinstance(v, float)})
    print("candidate fraction", round(st["candidate_fraction"], 4), "bypass fraction", round(st["bypass_fraction"], 4))
    # measured (2026-11-21, layers 2/9/16/23/29, 8 queries): the value in each comment
    assert rows[(0.05, False)]["recall"] >= 0.74  # 0.793
    assert rows[(0.10, False)]["recall"] >= 0.54  # 0.589 (the ~13% of candidates bound it)
    assert rows[(0.05, False)]["kv_touched"] <= 0.08  # 0.063 (topk: 0.056)
    assert rows[(0.05, True)]["rel_l2_err"] <= 0.17  # 0.139 (topk: 0.125)
    assert st["candidate_fraction"] <= 0.18  # 0.1305


@pytest.mark.slow
def test_decodes_with_the_model(lm):
    from conftest import PASSKEY_QUESTION, passkey_document
    from decoder.generate import ContextKV, generate
    from decoder.prefill import prefill

    cap = prefill(lm, lm.context_ids(passkey_document(30517)))
    ctx = ContextKV(cap.n_tokens, lambda name, layer: (cap.k if name == "kv/k" else cap.v)[layer])
    question = lm.question_ids(PASSKEY_QUESTION)
    full = get_method("full")
    ref = generate(lm, ctx, full.open(None, full.Params(), cap.n_tokens), full.Params(), question, max_tokens=10)
    lfps = get_method("lfps")
    params = lfps.Params()
    session = lfps.open(build_index(lfps, params, cap), params, cap.n_tokens)
    res = generate(lm, ctx, session, params, question, max_tokens=10)
    text = lm.tokenizer.decode(res.token_ids)
    st = session.stats()
    # KV touched by the single-token steps: remove the dense question step (fraction 1 per entry)
    spec = lm.spec
    dense_entries = len(question) * spec.num_layers * spec.num_kv_heads
    decode_kv = (res.stats.touched_sum - dense_entries) / (res.stats.touched_n - dense_entries)
    print("lfps:", repr(text), "decode kv", round(decode_kv, 3), "candidates", round(st["candidate_fraction"], 3),
          "bypass", round(st["bypass_fraction"], 3))
    assert st["dense_prompt_steps"] == 1
    assert res.token_ids[:4] == ref.token_ids[:4]  # "The pass key is"
    # measured: 'The pass key is 30517' (this key; 48213 and 55555 are missed, see RESULTS_psa_lfps.md)
    assert "30517" in text
    assert 0 < decode_kv < 0.25 and 0 < st["candidate_fraction"] < 0.5 and st["bypass_fraction"] < 0.5
