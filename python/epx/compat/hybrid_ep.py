"""HybridEP-compatible front over epx's routing-map operations: `HybridEPBuffer` with dispatch, combine,
dispatch_with_permute and combine_with_unpermute. Arguments epx cannot honour raise NotImplementedError
naming them. Needs torch.

Routing comes as routing_map [T, E] bool (+ probs [T, E] fp32) or as topk_idx [T, K] (+ topk_weights
[T, K]), converted here. Every call runs on the current stream; without an upper bound
(num_dispatched_tokens / num_permuted_tokens) the host waits for the received count, as HybridEP's
blocking mode does.
"""

import epx
from epx.compat.deep_ep import _torch, _unsupported


class HybridEPBuffer:
    """HybridEP's buffer over an epx communicator made from `group` (torch.distributed).

    num_topk (epx's own argument) bounds the experts a token may select; it defaults to
    min(E, 64) (larger costs buffer memory, never correctness)."""

    def __init__(self, group=None, hidden_dim=None, max_num_of_tokens_per_rank=None, num_local_experts=None,
                 use_fp8=False, num_sms_dispatch_api=0, num_sms_combine_api=0, num_sms_preprocessing_api=0,
                 num_of_hybrid_ep_ranks_per_nvlink_domain=None, use_mnnvl=None, num_topk=None,
                 max_pad_multiple=128, comm=None):
        _unsupported(use_mnnvl=(use_mnnvl, None))
        if hidden_dim is None or max_num_of_tokens_per_rank is None or num_local_experts is None:
            raise ValueError(
                "HybridEPBuffer needs hidden_dim, max_num_of_tokens_per_rank and num_local_experts")
        self.comm = comm if comm is not None else epx.Comm.from_torch(group)
        if num_of_hybrid_ep_ranks_per_nvlink_domain not in (None, self.comm.ranks_per_nvlink_domain):
            raise NotImplementedError(
                "epx.compat.hybrid_ep does not support: num_of_hybrid_ep_ranks_per_nvlink_domain = %d (epx "
                "detects %d; set EPX_RANKS_PER_NVLINK_DOMAIN)" % (num_of_hybrid_ep_ranks_per_nvlink_domain,
                                                                  self.comm.ranks_per_nvlink_domain))
        self.num_experts = num_local_experts * self.comm.nranks
        self.num_local_experts = num_local_experts
        self.hidden_dim = hidden_dim
        K = num_topk or min(self.num_experts, 64)
        dtypes = ["bf16", "fp8"] if use_fp8 else ["bf16"]
        self.buffer = epx.Buffer(self.comm, max_num_of_tokens_per_rank, hidden_dim, K, self.num_experts,
                                 modes="permute", dispatch_dtypes=dtypes, max_pad_multiple=max_pad_multiple,
                                 num_sms=max(num_sms_dispatch_api, num_sms_combine_api))

    def _routing(self, routing_map, probs, topk_idx, topk_weights, num_of_experts):
        if num_of_experts not in (None, self.num_experts):
            raise ValueError("num_of_experts = %d, the buffer has %d" % (num_of_experts, self.num_experts))
        if routing_map is not None:
            return routing_map, probs
        if topk_idx is None:
            raise ValueError("pass routing_map (and probs) or topk_idx (and topk_weights)")
        torch = _torch()
        T, E = topk_idx.shape[0], self.num_experts
        # Unused slots (-1) go to a spare column E, dropped after: scattering them onto a real expert
        # would race with (and could overwrite) a slot that selected it.
        valid = topk_idx >= 0
        col = torch.where(valid, topk_idx, torch.full_like(topk_idx, E)).long()
        routing_map = torch.zeros((T, E + 1), dtype=torch.bool, device=topk_idx.device)
        routing_map.scatter_(1, col, torch.ones_like(valid))
        routing_map = routing_map[:, :E].contiguous()
        if topk_weights is not None:
            probs = torch.zeros((T, E + 1), dtype=torch.float32, device=topk_idx.device)
            probs.scatter_(1, col, topk_weights.float())
            probs = probs[:, :E].contiguous()
        return routing_map, probs

    def dispatch(self, hidden, scaling_factor=None, topk_idx=None, topk_weights=None, num_of_experts=None,
                 probs=None, routing_map=None, num_dispatched_tokens_tensor=None, num_dispatched_tokens=None,
                 handle=None, async_mode=False):
        """hidden [T, H] -> (dispatched_token [N_r, H], dispatched_probs [N_r, L] or None,
        dispatched_scaling_factor or None, handle)."""
        with epx.collective(self.buffer, epx.RM_DISPATCH):
            _unsupported(handle=(handle, None), async_mode=(async_mode, False),
                         num_dispatched_tokens_tensor=(num_dispatched_tokens_tensor, None))
            routing_map, probs = self._routing(routing_map, probs, topk_idx, topk_weights, num_of_experts)
            out = self.buffer.rm_dispatch(hidden, routing_map, probs, scaling_factor,
                                          num_dispatched_tokens=num_dispatched_tokens)
        return out.tokens, out.probs, out.scaling_factor, out.handle

    def combine(self, hidden, probs=None, handle=None):
        """hidden [N_r, H] bf16 -> (combined_token [T, H] bf16, None): an unweighted sum over ranks."""
        with epx.collective(self.buffer, epx.RM_COMBINE):
            _unsupported(probs=(probs, None))
            return self.buffer.rm_combine(hidden, handle), None

    def dispatch_with_permute(self, hidden, routing_map=None, probs=None, scaling_factor=None, topk_idx=None,
                              topk_weights=None, num_of_experts_per_rank=None, pad_multiple=None, handle=None,
                              num_permuted_tokens=None, non_blocking=False, num_of_experts=None):
        """hidden [T, H] -> (dispatched_token [P, H], dispatched_probs [P] or None, dispatched_scaling_factor
        or None, tokens_per_expert [L] int32 (padded), handle). non_blocking needs num_permuted_tokens."""
        with epx.collective(self.buffer, epx.RM_DISPATCH):
            _unsupported(handle=(handle, None))
            if num_of_experts_per_rank not in (None, self.num_local_experts):
                raise ValueError("num_of_experts_per_rank = %d, the buffer has %d" % (
                    num_of_experts_per_rank, self.num_local_experts))
            if non_blocking and num_permuted_tokens is None:
                raise ValueError("non_blocking=True needs num_permuted_tokens (an upper bound on the rows)")
            routing_map, probs = self._routing(routing_map, probs, topk_idx, topk_weights, num_of_experts)
            out = self.buffer.rm_dispatch(hidden, routing_map, probs, scaling_factor, permute=True,
                                          pad_multiple=pad_multiple or 1,
                                          num_permuted_tokens=num_permuted_tokens)
        return out.tokens, out.probs, out.scaling_factor, out.tokens_per_expert, out.handle

    def combine_with_unpermute(self, hidden, probs=None, handle=None, pad_multiple=None, weighted=False):
        """hidden [P, H] bf16 in the permuted layout -> (combined_token [T, H] bf16, None). weighted=True
        weights each row by the prob it was dispatched with (other probs cannot be passed). pad_multiple
        is the dispatch's, which the handle already holds."""
        with epx.collective(self.buffer, epx.RM_COMBINE):
            _unsupported(probs=(probs, None))
            return self.buffer.rm_combine(hidden, handle, weighted=weighted), None
