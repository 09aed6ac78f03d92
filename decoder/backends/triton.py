"""`triton`: fused split-K attention over frame ∪ plan (`decoder/kernels/attention.py`).

The default backend on a GPU. One decode step of one layer is two kernel launches: a split kernel
that gathers the sink range, the window range, the plan's context rows and the request-local rows
straight from the K/V tensors (no gathered copy, no mask tensor), each K/V row loaded once for the
whole GQA group and all the step's tokens of a query block, and a merge kernel that combines the
splits' partial softmax states with the plan's pseudo-token (one launch when a single split
suffices). Launch sizes are host ints from shapes only: no host sync, capturable in a CUDA graph
(compile first: the first call of a new shape/dtype compiles). Results equal `torch_ref` (fp32:
ieee dots, no tf32; fp16/bf16: fp32 softmax and accumulation, P rounded to the input dtype before
P·V). Design, error bounds and H100 timings: `decoder/kernels/NOTES.md`.

A plan that carries its attention (`Plan.attended`: psa's fused plan attends the blocks it keeps
from the scores its exact sums take, `indexer/kernels/psa.py`) is not run again: `run` returns it
when it was computed for this very query tensor, frame and scale (`takes_attended`; the runner and
the decode step then ask planners for it through `KVView.attend_scale`).

Importing this module imports triton: without it the backend is not offered
(`decoder.backends._discover`). On a CPU `run` works only through Triton's interpreter
(`TRITON_INTERPRET=1`, the tests' CPU mode, far too slow to serve): `validate_configuration`
refuses any device but CUDA, so the service never picks it there.
"""

from __future__ import annotations

import torch

from decoder.backends import AttentionBackend, register_backend
from decoder.kernels import attention as kernels
from indexer.base import KVView, Plan


@register_backend
class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, cfg: kernels.KernelConfig | None = None):
        self.cfg = cfg or kernels.KernelConfig()

    @property
    def takes_attended(self) -> bool:  # `KernelConfig.take_attended` (A/B rows: "triton:take_attended=0")
        return self.cfg.take_attended

    def validate_configuration(self, spec, device, dtype) -> list[str]:
        reasons = kernels.unsupported(spec.head_dim, dtype)
        if torch.device(device).type != "cuda":  # Triton's CPU interpreter is for the kernel tests only
            reasons.append("the triton backend needs a CUDA device (on a CPU use torch_ref)")
        return reasons

    def run(self, q: torch.Tensor, kv: KVView, plan: Plan, sink: int, window: int, scale: float) -> torch.Tensor:
        if plan.attended is not None and self.takes_attended and plan.attended.serves(q, sink, window, scale):
            return plan.attended.out  # attended by the planner's kernels (psa): equal up to summation order
        if plan.is_dense:  # dense attention ignores the plan's extras, like torch_ref
            return kernels.frame_attention(q, kv.ctx_k, kv.ctx_v, kv.loc_k, kv.loc_v, kv.q_pos, None,
                                           sink, window, scale, cfg=self.cfg)
        blocks = plan.blocks  # read as ids where the list was made for this frame (a row cache takes positions)
        if blocks is not None and self.cfg.block_ids and kv.v_cache is None and blocks.frame_is(kv.q_pos, kv.n_ctx,
                                                                                                sink, window):
            rows, block_size = blocks.ids, blocks.size
        else:
            rows, block_size = plan.positions, 0
        return kernels.frame_attention(
            q, kv.ctx_k, kv.ctx_v, kv.loc_k, kv.loc_v, kv.q_pos, rows, sink, window, scale,
            bypass=plan.bypass, rest_logit=plan.rest_logit, rest_value=plan.rest_value, lengths=plan.lengths,
            cfg=self.cfg, v_cache=kv.v_cache, v_staged=kv.v_staged, block_size=block_size,
        )
