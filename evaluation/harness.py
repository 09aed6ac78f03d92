"""`ctxcache eval`: compare sparse methods on the same stored artifacts, through the service's code path.

Per document (a fidelity document or a task sample):

1. *prefill worker path* (`Artifacts.ensure`, as `service/jobs/prefill.py::PrefillWorker._build`): prompt
   hash over (model, tokenizer, token ids); if the context is not in the store yet, prefill once,
   `method.build` every index the config needs, `ContextStore.publish`; if it is, build only the
   missing indexes (`add_indexes`). A data dir is reused across runs: nothing already published is
   recomputed.
2. *decode worker path* (`ContextReader`, as `DecodeWorker._answer`): `ContextStore.open` and
   `decoder.pipeline.open_context` (per-layer arrays through the tiers, the method's planner, the
   `torch_ref` backend), then `decoder.generate` / `evaluation.fidelity.teacher_forced_logits`.
   Both paths are `decoder/pipeline.py`, the code the workers run.

Measurements:

* model level (any length): a continuation of the document is teacher-forced after the stored
  context with `full` (the reference) and with every method run; `evaluation.fidelity.fidelity` gives
  top-1 agreement and KL(full || method) per position (mean and max reported).
* attention level (any length): the reference run records every layer's real decode queries and the
  keys/values the continuation appends. Each method run replays the first `queries` of them through a
  fresh planner (plan -> `torch_ref` over frame ∪ plan, then update, as the decoder does) and is
  compared with exact attention, per layer and KV head: recall of the exact top-K (K =
  `recall_ratio` of the visible tokens, the group attention mass of `indexer/topk.py`), the share
  of the exact attention mass the attended set covers, relative L2 error of the attention output vs
  dense, and the fraction of the visible KV attended. LFPS's bypassed heads (which attend the frame
  and a pseudo-token instead of the plan) are counted in `bypass_fraction`.
* task accuracy (short lengths): RULER-style samples (`evaluation/tasks.py`), greedy
  `generate`, scored by RULER's substring match.

The config and its runs are `evaluation/config.py`; publishing and opening the stored contexts is
`evaluation/contexts.py`; the outputs (JSON, markdown, plots) are `evaluation/report.py`.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from decoder.backends import frame_fraction
from decoder.generate import ContextKV, generate
from evaluation import tasks as T
from evaluation.config import EvalConfig, Run, expand_runs
from evaluation.contexts import Artifacts, ContextReader, Published
from evaluation.fidelity import QueryTrace, attention_metrics, fidelity, teacher_forced_logits
from indexer.base import MethodParams, Planner, get_method
from storage.artifacts import ContextStore

log = logging.getLogger("ctxcache.eval")


# ---------------------------------------------------------------------------------------------
# Planners observed from outside (the method never knows)


class ObservedPlanner(Planner):
    """Delegates to a method's planner; records the fraction of visible KV each (layer, step) attends
    and, when `record` is set, the queries and the appended keys/values (the reference trace)."""

    def __init__(self, inner: Planner, params: MethodParams, n_ctx: int, record: bool = False):
        self.inner = inner
        self.sink, self.window = params.frame(n_ctx)
        self.record = record
        self.q: dict[int, list[torch.Tensor]] = {}  # layer -> per step [KVH, G, 1, D]
        self.k: dict[int, list[torch.Tensor]] = {}  # layer -> per step [KVH, 1, D]
        self.v: dict[int, list[torch.Tensor]] = {}
        self.touched_sum = 0.0
        self.touched_n = 0

    def plan(self, layer, q, kv):
        if self.record:
            self.q.setdefault(layer, []).append(q.detach().clone())
        plan = self.inner.plan(layer, q, kv)
        frac = frame_fraction(plan, kv, self.sink, self.window)
        self.touched_sum += float(frac.double().sum())
        self.touched_n += frac.numel()
        return plan

    def update(self, layer, k, v, positions):
        if self.record:
            self.k.setdefault(layer, []).append(k.detach().clone())
            self.v.setdefault(layer, []).append(v.detach().clone())
        self.inner.update(layer, k, v, positions)

    def stats(self) -> dict:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    @property
    def kv_fraction(self) -> float:
        return self.touched_sum / max(self.touched_n, 1)

    def trace(self, n_ctx: int, steps: int) -> "QueryTrace":
        layers = sorted(self.q)
        return QueryTrace(
            q=torch.stack([torch.cat(self.q[l][:steps], dim=2) for l in layers]),
            k=torch.stack([torch.cat(self.k[l][:steps], dim=1) for l in layers]),
            v=torch.stack([torch.cat(self.v[l][:steps], dim=1) for l in layers]),
            n_ctx=n_ctx,
        )


# ---------------------------------------------------------------------------------------------
# The evaluation


@dataclass
class Evaluation:
    config: EvalConfig
    lm: Any
    artifacts: Artifacts
    runs: list[Run]
    results: dict = field(default_factory=dict)
    on_progress: Callable[[dict], None] | None = None  # called with the partial results after each document

    @classmethod
    def create(cls, config: EvalConfig, lm=None) -> "Evaluation":
        from decoder.model import load_model

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        if lm is None:
            lm = load_model(config.model, config.model_cache or config.data_dir)
        store = ContextStore(Path(config.data_dir) / "contexts")
        arts = Artifacts(lm, store, tier_bytes=config.dram_tier_bytes, chunk_tokens=config.prefill_chunk_tokens,
                         prompt_format=config.prompt_format)
        return cls(config, lm, arts, expand_runs(config.methods))

    # -- helpers --------------------------------------------------------------------------------

    def _resolve(self, n_ctx: int) -> dict[str, dict]:
        """Per run: method, concrete params, and the reasons it cannot run (empty = it can)."""
        out = {}
        for r in self.runs:
            method = get_method(r.method)
            params = r.params_for(n_ctx)
            out[r.label] = {"run": r, "method": method, "params": params,
                            "reasons": method.validate_configuration(self.lm.spec, params)}
        return out

    def _publish(self, ids: list[int], resolved: dict[str, dict]) -> Published:
        wanted = {}
        for e in resolved.values():
            if e["method"].has_index and not e["reasons"]:
                wanted[e["method"].index_id(e["params"], self.lm.spec)] = (e["method"], e["params"])
        return self.artifacts.ensure(ids, wanted)

    def _unavailable(self, e: dict, pub: Published) -> dict | None:
        if e["reasons"]:
            return {"status": "skipped", "reason": "; ".join(e["reasons"])}
        if e["method"].has_index:
            index_id = e["method"].index_id(e["params"], self.lm.spec)
            if index_id in pub.failed:
                return {"status": "failed", "reason": f"index build: {pub.failed[index_id]}"}
        return None

    def _doc_info(self, pub: Published) -> dict:
        return {"prompt_hash": pub.key.hex, "n_tokens": pub.n_tokens, "reused": pub.reused,
                "prefill_s": round(pub.prefill_s, 3), "index_build_s": {k: round(v, 3) for k, v in pub.built.items()}}

    def _emit(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.results)

    def fmt_ids(self, text: str) -> list[int]:
        return self.lm.context_ids(text, self.config.prompt_format)

    # -- fidelity + attention ---------------------------------------------------------------------

    def fidelity_document(self, n: int) -> tuple[list[int], list[int]]:
        """Token ids of a context of exactly n tokens and of its `positions`-token continuation."""
        fc = self.config.fidelity
        need = n + fc.positions
        rng_off = 97 * fc.seed
        words = 1.0
        while True:
            if fc.source == "natural":
                text = T.natural_text(max(8, int(need * words / 12)), offset=rng_off)
            else:
                text = " ".join([T.NOISE] * max(4, int(need * words / 20)))
            ids = self.fmt_ids(text)
            if len(ids) >= need:
                return ids[:n], ids[n:need]
            words *= 1.5

    def run_fidelity(self) -> list[dict]:
        fc = self.config.fidelity
        out = self.results.setdefault("fidelity", [])
        full = get_method("full")
        full_params = full.Params()
        for n in fc.lengths:
            t_doc = time.perf_counter()
            ctx_ids, cont = self.fidelity_document(n)
            resolved = self._resolve(n)
            pub = self._publish(ctx_ids, resolved)
            reader = self.artifacts.reader(pub.key)
            ctx = reader.context_kv()
            t0 = time.perf_counter()
            ref_session = ObservedPlanner(reader.planner(full, full_params), full_params, n, record=True)
            ref = teacher_forced_logits(self.lm, ctx, ref_session, full_params, cont)
            ref_s = time.perf_counter() - t0
            trace = ref_session.trace(n, fc.queries) if fc.queries else None
            entry = {"length": n, "document": self._doc_info(pub), "reference_s": round(ref_s, 3), "results": {}}
            out.append(entry)
            log.info("fidelity n=%d: %s, prefill %.1fs, reference %.1fs", n, "reused" if pub.reused else "published",
                     pub.prefill_s, ref_s)
            for label, e in resolved.items():
                res = self._unavailable(e, pub)
                if res is None:
                    res = self._fidelity_one(e, reader, ctx, cont, ref, trace)
                entry["results"][label] = res
                log.info("  %-28s %s", label, _short(res))
                self._emit()
            entry["wall_s"] = round(time.perf_counter() - t_doc, 2)
        return out

    def _fidelity_one(self, e: dict, reader: ContextReader, ctx: ContextKV, cont: list[int], ref: torch.Tensor,
                      trace: QueryTrace | None) -> dict:
        method, params = e["method"], e["params"]
        res: dict = {"status": "ok", "method": method.name, "params": params.model_dump()}
        try:
            t0 = time.perf_counter()
            sess = ObservedPlanner(reader.planner(method, params, len(cont)), params, reader.n_tokens)
            logits = teacher_forced_logits(self.lm, ctx, sess, params, cont)
            res.update(fidelity(ref, logits))
            res["kv_touched_decode"] = sess.kv_fraction
            res["teacher_forced_s"] = round(time.perf_counter() - t0, 3)
            if trace is not None:
                t1 = time.perf_counter()
                planner = reader.planner(method, params, trace.steps)
                try:
                    rep = attention_metrics(planner, params, ctx.layer, trace,
                                            recall_ratio=self.config.fidelity.recall_ratio)
                finally:
                    planner.close()
                res["attention"] = rep.summary()
                res["attention"]["queries"] = trace.steps
                res["attention_s"] = round(time.perf_counter() - t1, 3)
        except Exception as ex:  # noqa: BLE001 - a broken method is reported, the comparison goes on
            log.exception("%s failed", e["run"].label)
            return {"status": "failed", "method": method.name, "reason": f"{type(ex).__name__}: {ex}"[:500]}
        return res

    # -- tasks ------------------------------------------------------------------------------------

    def run_tasks(self) -> list[dict]:
        tc = self.config.tasks
        out = self.results.setdefault("tasks", [])
        tok = self.lm.tokenizer
        count = lambda text: len(self.fmt_ids(text))  # noqa: E731
        for n in tc.lengths:
            for name in tc.names:
                entry = {"task": name, "length": n, "samples": [], "accuracy": {}}
                out.append(entry)
                for i, depth in enumerate(tc.sample_depths()):
                    s = T.make_sample(name, count, n, seed=tc.seed + i, depth=depth)
                    ids = self.fmt_ids(s.context)
                    resolved = self._resolve(len(ids))
                    pub = self._publish(ids, resolved)
                    reader = self.artifacts.reader(pub.key)
                    q_ids = self.lm.question_ids(s.question, self.config.prompt_format)
                    if tc.answer_prefix and s.answer_prefix:
                        q_ids = q_ids + tok(s.answer_prefix, add_special_tokens=False)["input_ids"]
                    rec = {"seed": s.seed, "depth": s.depth, "n_tokens": len(ids), "answers": s.answers,
                           "metric": s.metric, "document": self._doc_info(pub), "results": {}}
                    entry["samples"].append(rec)
                    for label, e in resolved.items():
                        res = self._unavailable(e, pub)
                        if res is None:
                            res = self._task_one(e, reader, s, q_ids, tc.max_tokens or s.max_tokens)
                        rec["results"][label] = res
                    log.info("task %s n=%d depth=%s: %s", name, len(ids), s.depth,
                             " ".join(f"{k}={v.get('score', v['status'])}" for k, v in rec["results"].items()))
                    self._emit()
                for label in resolved:
                    scores = [r["results"][label]["score"] for r in entry["samples"] if r["results"][label]["status"] == "ok"]
                    entry["accuracy"][label] = sum(scores) / len(scores) if scores else None
        return out

    def _task_one(self, e: dict, reader: ContextReader, s: T.TaskSample, q_ids: list[int], max_tokens: int) -> dict:
        method, params = e["method"], e["params"]
        try:
            t0 = time.perf_counter()
            opened = reader.open(method, params, len(q_ids) + max_tokens)
            res = generate(self.lm, opened.kv, opened.planner, params, q_ids, backend=opened.backend,
                           max_tokens=max_tokens, temperature=0.0)
            text = self.lm.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        except Exception as ex:  # noqa: BLE001
            log.exception("%s failed", e["run"].label)
            return {"status": "failed", "reason": f"{type(ex).__name__}: {ex}"[:500]}
        return {"status": "ok", "prediction": text, "score": s.score(text), "kv_fraction": res.stats.kv_fraction,
                "tokens": len(res.token_ids), "wall_s": round(time.perf_counter() - t0, 3)}

    # -- all --------------------------------------------------------------------------------------

    def run(self) -> dict:
        t0 = time.perf_counter()
        spec = self.lm.spec
        self.results.update({
            "name": self.config.name,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": json.loads(self.config.model_dump_json()),
            "machine": machine_info(),
            "model": {"name": spec.name, "fingerprint": spec.fingerprint[:16], "layers": spec.num_layers,
                      "heads": spec.num_heads, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
            "natural_source": T.natural_source(),
            "runs": [{"label": r.label, "method": r.method, "params": dict(r.raw_params)} for r in self.runs],
        })
        if self.config.fidelity is not None:
            self.run_fidelity()
        if self.config.tasks is not None:
            self.run_tasks()
        self.results["runtime_s"] = round(time.perf_counter() - t0, 1)
        self.results["finished"] = True
        return self.results


def _short(res: dict) -> str:
    if res["status"] != "ok":
        return f"{res['status']}: {res.get('reason', '')[:120]}"
    a = res.get("attention", {})
    return (f"agree={res['top1_agreement']:.3f} kl={res['kl_mean']:.4f} touched={res['kv_touched_decode']:.3f} "
            f"recall={a.get('recall')} err={a.get('rel_l2_err', float('nan')):.3f}")


def machine_info() -> dict:
    info = {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    try:
        info["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout.splitlines()[:15]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def run_eval(config: EvalConfig, out_dir: Path | str, lm=None) -> dict:
    """Run a config and write results.json, results.md and the plots into out_dir."""
    from evaluation import report

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ev = Evaluation.create(config, lm=lm)
    ev.on_progress = lambda res: report.write_json(res, out_dir / "results.json")
    results = ev.run()
    report.write_all(results, out_dir)
    return results
