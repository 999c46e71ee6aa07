"""Tensor parallelism (Megatron-LM's layout): one process per device, each holding a slice
of every weight matrix, over a torch.distributed process group (NCCL on GPUs, gloo on CPU).

- ColumnParallelLinear: the output features split across ranks; each rank's output is its
  slice (no gather: the next row-parallel layer consumes slices). A merged layer (fused
  q/k/v, gate/up) splits each of its pieces separately, so that every rank holds its q
  heads and its kv heads, its gate rows and its up rows.
- RowParallelLinear: the input features split; the partial products are summed by an
  all_reduce, and the bias added once, after it.
- VocabParallelEmbedding: each rank owns a slice of the vocabulary (ceil(vocab / size)
  rows, the last one zero-padded); a lookup of another rank's token gives zeros, and an
  all_reduce sums the one non-zero row per token.
- ParallelLMHead: each rank computes the logits of its vocabulary slice; an all_gather
  gives every rank the full logits. Tied weights share the embedding's slice.

Each layer loads its own slice: ``full_shape(name, shard)`` is the shape of the
checkpoint tensor that parameter ``name`` comes from, and ``load_weight(name, full,
shard)`` copies this rank's part of it (shard: the index of a merged layer's piece; None:
the whole parameter's full tensor). ``full`` is read by basic slicing only, so it may be a
safetensors slice (``safe_open(...).get_slice(name)``): each rank then reads only its part
of the file. With a group of size 1 every layer computes exactly what nn.Linear /
nn.Embedding compute and calls no collective.

Replicating kv heads when the group has more ranks than the model has kv heads (vLLM
does) is not supported: num_key_value_heads must be a multiple of tensor_parallel_size.
LLM(tensor_parallel_size=N) starts the processes and their group (engine/workers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashtile._validate import _fail
from flashtile.engine.gemv import linear


def group_rank(group=None) -> int:
    """This process's rank in group (default: the default group); 0 without one."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def group_size(group=None) -> int:
    """Ranks in group (default: the default group); 1 without torch.distributed."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


@dataclass(frozen=True)
class ParallelGroup:
    """The ranks one model is split over; size 1 (the default) runs no collective."""

    rank: int = 0
    size: int = 1
    group: Optional[object] = None  # a torch.distributed ProcessGroup; None: the default

    @classmethod
    def for_size(cls, tensor_parallel_size: int, group=None) -> "ParallelGroup":
        """The group of tensor_parallel_size ranks: torch.distributed's group (default:
        the default group), which must be initialised with that many ranks."""
        if tensor_parallel_size == 1:
            return cls()
        if group_size(group) != tensor_parallel_size:
            _fail(ValueError, "tensor_parallel_size", "the size of an initialised "
                  "torch.distributed group", f"{tensor_parallel_size} with "
                  f"{group_size(group)} process(es)", "Call torch.distributed."
                  "init_process_group(world_size=tensor_parallel_size) in each process")
        return cls(group_rank(group), tensor_parallel_size, group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """x of the group's first rank, written into x on every rank."""
        if self.size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group or dist.group.WORLD, 0),
                           group=self.group)
        return x

    def min(self, value: int, device) -> int:
        """The smallest of every rank's value (an int), on every rank."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = ParallelGroup()


def _split(total: int, what: str, size: int) -> int:
    if total % size:
        _fail(ValueError, "tensor_parallel_size", f"a divisor of {what} {total}", size)
    return total // size


def _check_heads(num_heads: int, num_kv_heads: int, size: int):
    for heads, what in ((num_heads, "num_attention_heads"),
                        (num_kv_heads, "num_key_value_heads")):
        if heads % size:
            _fail(ValueError, "tensor_parallel_size", f"a divisor of the model's {what} "
                  f"{heads}", size, "Replicating kv heads over more ranks than the model "
                  "has is not supported")


def check_model_split(config, size: int):
    """Raise ValueError unless a model of this ModelConfig splits over size ranks: its
    query heads, kv heads and MLP features divide evenly (the vocabulary need not)."""
    _check_heads(config.num_attention_heads, config.num_key_value_heads, size)
    _split(config.intermediate_size, "intermediate_size", size)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split across ranks; output_sizes: the
    full sizes of the merged pieces (one piece: a plain column-parallel linear). Each rank
    holds rows [rank * n / size, (rank + 1) * n / size) of every piece, pieces in order."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp: ParallelGroup = SINGLE, names: Optional[list[str]] = None):
        super().__init__()
        self.tp, self.output_sizes = tp, list(output_sizes)
        names = names or ["output features"] * len(output_sizes)
        self.local_sizes = [_split(n, what, tp.size) for n, what in zip(output_sizes, names)]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes))) if bias else None

    def forward(self, x):
        return linear(x, self.weight, self.bias)

    def full_shape(self, name: str, shard: Optional[int] = None) -> tuple:
        rows = sum(self.output_sizes) if shard is None else self.output_sizes[shard]
        return (rows, self.weight.shape[1]) if name == "weight" else (rows,)

    def load_weight(self, name: str, full, shard: Optional[int] = None):
        param = getattr(self, name)
        for i in range(len(self.output_sizes)) if shard is None else [shard]:
            n = self.local_sizes[i]
            start = self.tp.rank * n + (0 if shard is not None else sum(self.output_sizes[:i]))
            param.narrow(0, sum(self.local_sizes[:i]), n).copy_(full[start:start + n])


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; each rank gets num_heads / size query heads and
    num_kv_heads / size kv heads (the kv heads its query heads read, in GQA order)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False, tp: ParallelGroup = SINGLE):
        _check_heads(num_heads, num_kv_heads, tp.size)
        d = head_dim
        super().__init__(hidden_size, [num_heads * d, num_kv_heads * d, num_kv_heads * d],
                         bias, tp)
        self.num_heads, self.num_kv_heads = num_heads // tp.size, num_kv_heads // tp.size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Fused gate/up projection: the gate and the up halves split separately, so each rank's
    output is [its gate rows | its up rows] and SiLU-and-multiply works on it unchanged."""

    def __init__(self, in_features: int, intermediate_size: int, tp: ParallelGroup = SINGLE):
        super().__init__(in_features, [intermediate_size] * 2, False, tp,
                         names=["intermediate_size"] * 2)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (input features) split: x is this rank's slice of the
    features (a column-parallel layer's output); the partial products are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: ParallelGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features,
                                               _split(in_features, "input features", tp.size)))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x, product=linear):
        """product(x, weight, bias): ``linear``, or a GEMV that transforms x first
        (engine/gemv.py's ``gemv_silu``)."""
        if self.tp.size == 1:
            return product(x, self.weight, self.bias)
        y = self.tp.all_reduce(product(x, self.weight, None))
        return y if self.bias is None else y + self.bias  # added once, not once per rank

    def full_shape(self, name: str, shard: Optional[int] = None) -> tuple:
        out, n = self.weight.shape
        return (out, n * self.tp.size) if name == "weight" else (out,)

    def load_weight(self, name: str, full, shard: Optional[int] = None):
        if name == "bias":
            self.bias.copy_(full[:])
            return
        n = self.weight.shape[1]
        self.weight.copy_(full[:, self.tp.rank * n:(self.tp.rank + 1) * n])


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [rank * n, (rank + 1) * n) with n = ceil(vocab / size); the padding
    rows past the vocabulary (last rank) are zeros and never looked up."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: ParallelGroup = SINGLE):
        super().__init__()
        self.tp, self.num_embeddings = tp, num_embeddings
        self.rows = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim))

    def forward(self, input_ids):
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(~mine[:, None], 0))

    def full_shape(self, name: str, shard: Optional[int] = None) -> tuple:
        return (self.num_embeddings, self.weight.shape[1])

    def load_weight(self, name: str, full, shard: Optional[int] = None):
        n = max(0, min(self.rows, self.num_embeddings - self.start))
        self.weight[:n].copy_(full[self.start:self.start + n])
        self.weight[n:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = hidden W^T over the vocabulary slice of each rank, gathered: every rank gets
    the full (rows, vocab_size) logits."""

    def forward(self, hidden):
        logits = self.tp.all_gather(linear(hidden, self.weight))
        return logits if self.tp.size == 1 else logits[:, :self.num_embeddings]
