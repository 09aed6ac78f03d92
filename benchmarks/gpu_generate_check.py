"""GPU check of the whole decode path (device tool): `generate` / teacher-forced decoding through the
registered attention hook with the model on the GPU, as the decode worker runs it.

The default model's weights do not travel to the device machine (98 MB GGUF, 540 MB fp32), so the
model is SmolLM2-135M's architecture (30 layers, 9 query / 3 KV heads, d 64, rope_theta 1e5) with
seeded random weights; the context is 2,048 random token ids. Checks, each printed as one line:

  1. `full` through the ctxcache hook (context K/V captured, stored on the host, loaded back;
     continuation fed one token at a time) vs transformers' own SDPA forward over context +
     continuation on the same GPU: teacher-forced logits over 16 tokens agree. (GPU vs CPU
     captures are reported, not checked: with random weights 30 layers amplify rounding.)
  2. csattn All-GPU (K/V and tables on the GPU) vs csattn CPU<->GPU (`mode="offload"`: context K/V
     and tables in host memory, as the decode worker keeps them for a host-resident method; only
     the selected rows shipped), with overlap "updates" and "lookahead": logits agree with All-GPU
     for "updates" (the same selections; the search runs on another device, so near-ties may
     differ); "lookahead" uses the previous step's query, so only its agreement is reported.
  3. `generate` (greedy, 16 tokens) runs to the end with the offload session, which is closed after.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_generate_check.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decoder.fidelity import fidelity, teacher_forced_logits  # noqa: E402
from decoder.generate import ContextKV, generate  # noqa: E402
from decoder.model import LoadedModel, ModelSpec  # noqa: E402
from decoder.prefill import prefill  # noqa: E402
from indexer.base import IndexReader, get_method  # noqa: E402


def smollm2_shaped(device: str) -> LoadedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    from decoder.attention import ATTN_IMPLEMENTATION, register_attention

    register_attention()
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, attn_implementation=ATTN_IMPLEMENTATION)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    qk_scale = float(os.environ.get("CHECK_QK_SCALE", "3"))
    with torch.no_grad():  # init's 0.02 std makes attention ~uniform; sharper, but not chaotic over 30 layers
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    spec = ModelSpec(name="smollm2-shaped-random", fingerprint="1" * 64, tokenizer_fingerprint="1" * 64, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64, max_positions=8192, rope_theta=1e5,
                     rope_type="default", dtype="float32")
    return LoadedModel(spec=spec, tokenizer=None, model=model.to(device), eos_token_ids=())


def main() -> int:
    dev = os.environ.get("CHECK_DEVICE", "cuda")  # CHECK_DEVICE=cpu: a dry run of the script itself
    assert dev == "cpu" or torch.cuda.is_available(), "needs a GPU"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 49152, (2048,), generator=g).tolist()
    cont = torch.randint(0, 49152, (16,), generator=g).tolist()
    ok = True

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the comparisons below
    torch.backends.cudnn.allow_tf32 = False
    full = get_method("full")
    lm = smollm2_shaped(dev)
    t0 = time.perf_counter()
    cap = prefill(lm, ids)  # captured on the GPU, persisted from the host in the service
    print(f"prefill 2048 tokens on {dev}: {time.perf_counter() - t0:.2f} s", flush=True)
    k_host, v_host = cap.k.cpu(), cap.v.cpu()
    gpu_kv = ContextKV(len(ids), lambda name, layer: {"kv/k": k_host, "kv/v": v_host}[name][layer], dev)
    host_kv = ContextKV(len(ids), lambda name, layer: {"kv/k": k_host, "kv/v": v_host}[name][layer], "cpu")
    ref = teacher_forced_logits(lm, gpu_kv, full.open(None, full.Params(), len(ids)), full.Params(), cont)

    # the reference: transformers' own SDPA attention, one forward over context + continuation
    from decoder.attention import ATTN_IMPLEMENTATION

    lm.model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([ids + cont], device=dev)).logits[0, len(ids):].float().cpu()
    lm.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    d = (ref - logits).abs().max().item()
    f = fidelity(logits, ref)
    good = d < 1e-2 and f["top1_agreement"] == 1.0
    ok &= good
    print(f"[{'ok' if good else 'FAIL'}] full via the ctxcache hook (stored K/V, one token at a time) vs transformers "
          f"SDPA forward, same device: max |logit diff| {d:.2e}, top-1 {f['top1_agreement']:.3f}", flush=True)

    cpu_lm = smollm2_shaped("cpu")
    cap_cpu = prefill(cpu_lm, ids, keep_q=False)
    dk = [(cap_cpu.k[i] - k_host[i]).abs().max().item() for i in (0, 15, 29)]
    print(f"[info] captured K, {dev} vs CPU, max |diff| at layers 0/15/29: " + " / ".join(f"{x:.1e}" for x in dk),
          flush=True)

    cs = get_method("csattn")
    p_gpu = cs.Params(mode="gpu")
    arrays = {k: v.cpu() for k, v in cs.build(cap, p_gpu).items()}  # built on the GPU, stored on the host
    reader_gpu = IndexReader(lambda name, layer: arrays[name][layer].to(dev), sorted(arrays))
    reader_host = IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))
    allgpu = teacher_forced_logits(lm, gpu_kv, cs.open(reader_gpu, p_gpu, len(ids)), p_gpu, cont)
    fa = fidelity(ref, allgpu)
    print(f"[info] csattn All-GPU vs full: top-1 {fa['top1_agreement']:.3f}, KL {fa['kl_mean']:.3f}", flush=True)
    assert cs.host_resident(cs.Params(mode="offload")) and not cs.host_resident(p_gpu)
    for overlap in ("updates", "lookahead"):
        p = cs.Params(mode="offload", overlap=overlap)
        s = cs.open(reader_host, p, len(ids))
        t0 = time.perf_counter()
        off = teacher_forced_logits(lm, host_kv, s, p, cont)
        dt = (time.perf_counter() - t0) / len(cont)
        s.close()
        fo = fidelity(allgpu, off)
        if overlap == "updates":
            good = fo["top1_agreement"] >= 0.9 and fo["kl_mean"] < 0.05
            ok &= good
            tag = "ok" if good else "FAIL"
        else:
            tag = "info"
        print(f"[{tag}] csattn offload ({overlap}) vs All-GPU: top-1 {fo['top1_agreement']:.3f}, KL {fo['kl_mean']:.2e}, "
              f"max |logit diff| {(off - allgpu).abs().max().item():.2e}; {1000 * dt:.1f} ms/token", flush=True)

    p = cs.Params(mode="offload")
    s = cs.open(reader_host, p, len(ids))
    res = generate(lm, host_kv, s, p, cont[:4], max_tokens=16)
    good = len(res.token_ids) == 16 and 0 < res.stats.kv_fraction < 1
    ok &= good
    print(f"[{'ok' if good else 'FAIL'}] generate with csattn offload on the GPU: {len(res.token_ids)} tokens, "
          f"kv_fraction {res.stats.kv_fraction:.3f}, finish {res.finish_reason}", flush=True)
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
