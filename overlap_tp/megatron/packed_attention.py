"""Attention over packed sequences (Megatron's THD format, `PackedSeqParams`) without Transformer Engine.

A packed micro-batch is one row of t tokens holding several sequences back to back; `cu_seqlens_q` / `cu_seqlens_kv`
(int32, [N + 1]) give where each starts, and where `cu_seqlens_*_padded` is given, each sequence starts at its padded
offset and its real length is the unpadded one (the rest of its slot is padding). Every token attends only to the
tokens of its own sequence (causally where the mask type is causal, aligned at the sequence's first token), so the
result is, token for token, each sequence's attention run alone. The linear layers around attention see tokens only
and need nothing.

Two ways to run it, chosen per call from what the call needs:

    varlen   torch.nn.attention.varlen.varlen_attn (Flash Attention on cu_seqlens, no mask): CUDA, bf16 / fp16, no
             attention dropout, not --deterministic-mode, value heads the size of the query heads (not MLA's),
             sequences without padding inside their slots or a causal
             mask (a causal query never sees the padding after its sequence's real tokens)
    masked   torch's scaled_dot_product_attention on the whole row with a block-diagonal document mask built on the
             device from cu_seqlens (t x t booleans; no host sync): everything else, the CPU, dropout and
             --deterministic-mode (the math kernel) included

Tokens after the last sequence (cu_seqlens[-1] < t) form one more sequence of their own. `max_seqlen_q` /
`max_seqlen_kv`, where given, must cover every sequence's slot, that one included (Megatron's do); where they are
None the varlen path reads them from cu_seqlens (one host sync).
"""
from typing import Optional

import torch

__all__ = ["document_mask", "max_seqlen", "uses_varlen", "varlen_attention"]

VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def _bounds(packed, side: str):
    """(the sequences' starts in the packed row [N + 1], their real lengths [N] or None where there is no padding)."""
    cu = getattr(packed, f"cu_seqlens_{side}")
    padded = getattr(packed, f"cu_seqlens_{side}_padded")
    if cu is None:
        raise ValueError(f"packed sequences: packed_seq_params.cu_seqlens_{side} is None")
    if padded is None:
        return cu, None
    if padded.shape != cu.shape:
        raise ValueError(f"packed sequences: cu_seqlens_{side}_padded has shape {tuple(padded.shape)}, cu_seqlens_{side} "
                         f"{tuple(cu.shape)}: one entry per sequence boundary in each")
    return padded, cu[1:] - cu[:-1]


def _segments(starts, lengths, tokens: int, device):
    """Per token of the packed row: (its sequence, its position in the sequence, whether it is a real token)."""
    starts = starts.to(device=device, dtype=torch.int64)
    position = torch.arange(tokens, device=device, dtype=torch.int64)
    sequence = torch.searchsorted(starts[1:], position, right=True)     # N for the tokens after the last sequence
    first = torch.cat([starts[:-1], starts[-1:]])[sequence]
    local = position - first
    if lengths is None:
        return sequence, local, None
    lengths = torch.cat([lengths.to(device=device, dtype=torch.int64), position.new_full((1,), tokens)])
    return sequence, local, local < lengths[sequence]


def document_mask(packed, tokens_q: int, tokens_kv: int, causal: bool, device) -> torch.Tensor:
    """[tokens_q, tokens_kv] booleans, True where query i may attend to key j: same sequence, j a real token of
    it, and, with `causal`, j's position in the sequence <= i's."""
    starts_q, lengths_q = _bounds(packed, "q")
    starts_kv, lengths_kv = _bounds(packed, "kv")
    if starts_q.shape != starts_kv.shape:
        raise ValueError(f"packed sequences: {starts_q.numel() - 1} query sequences, {starts_kv.numel() - 1} key / value "
                         f"sequences: the same number expected")
    seq_q, local_q, _ = _segments(starts_q, lengths_q, tokens_q, device)
    seq_kv, local_kv, real_kv = _segments(starts_kv, lengths_kv, tokens_kv, device)
    mask = seq_q[:, None] == seq_kv[None, :]
    if real_kv is not None:
        mask &= real_kv[None, :]
    if causal:
        mask &= local_kv[None, :] <= local_q[:, None]
    return mask


def max_seqlen(packed, side: str, tokens: int) -> int:
    """The longest sequence's slot (padded where padding is given) in a packed row of `tokens`, from
    packed_seq_params.max_seqlen_* where set (Megatron's data path sets it), else from cu_seqlens (one host sync)."""
    given = getattr(packed, f"max_seqlen_{side}", None)
    if given is not None:
        return int(given)
    starts = _closed(_bounds(packed, side)[0], tokens)
    return int((starts[1:] - starts[:-1]).max())


def uses_varlen(query, packed, *, causal: bool, dropout_p: float, deterministic: bool,
                value_head_dim: Optional[int] = None) -> bool:
    """Whether `varlen_attention` can run this call (see the module docstring); else the masked path runs.
    value_head_dim: the value heads' size where it differs from the query's (MLA), which Flash Attention does not
    take."""
    if not (query.is_cuda and query.dtype in VARLEN_DTYPES) or dropout_p > 0.0 or deterministic:
        return False
    if value_head_dim is not None and value_head_dim != query.shape[-1]:
        return False
    padded = packed.cu_seqlens_q_padded is not None or packed.cu_seqlens_kv_padded is not None
    if padded and not causal:
        return False
    try:
        parameters = _varlen_parameters()
    except ImportError:
        return False
    return "window_size" in parameters or "is_causal" in parameters


def _varlen_parameters() -> frozenset:
    """The keyword parameters of this torch's varlen_attn (they differ between releases: `is_causal` or
    `window_size`, `enable_gqa` or none)."""
    import inspect
    from torch.nn.attention.varlen import varlen_attn
    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_attention(query, key, value, packed, *, causal: bool, scale: Optional[float]) -> torch.Tensor:
    """query [t, np, hn], key / value [t, ng, hn] -> [t, np, hn] through varlen_attn (ng divides np; where this
    torch's varlen_attn takes no `enable_gqa`, each key / value head is repeated for its np / ng query heads)."""
    from torch.nn.attention.varlen import varlen_attn
    parameters = _varlen_parameters()
    kwargs = {"scale": scale}
    if "window_size" in parameters:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in parameters:
            kwargs["enable_gqa"] = True
        else:
            repeats = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    # the tokens after the last sequence as one more sequence (of length 0 where there are none), as the masked path
    starts_q = _closed(_bounds(packed, "q")[0], query.shape[0])
    starts_kv = _closed(_bounds(packed, "kv")[0], key.shape[0])
    return varlen_attn(query, key, value, starts_q, starts_kv, max_seqlen(packed, "q", query.shape[0]),
                       max_seqlen(packed, "kv", key.shape[0]), **kwargs)


def _closed(starts, tokens: int) -> torch.Tensor:
    return torch.cat([starts.to(torch.int32), starts.new_full((1,), tokens, dtype=torch.int32)])
