"""Tensor parallelism: which share of every weight a worker holds (Megatron-LM, section 3).

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism", section 3) splits each transformer block over ``N``
workers so that a block needs one sum across them for attention and one for the MLP.
Written as ``Y = X A`` with ``A [in, out]``:

* **Column-parallel** ``A = [A_1 | ... | A_N]`` (split on the output axis): worker ``r``
  computes ``Y_r = X A_r``, its own columns of ``Y``; nothing is exchanged (Megatron's ``f``
  is the identity in the forward pass). q/k/v and gate/up are split this way, so each
  worker owns whole attention heads and a slice of the MLP's intermediate features, and
  everything in between (RoPE, the KV cache write, attention, the activation) runs on its
  own share alone.
* **Row-parallel** ``A = [A_1; ...; A_N]`` (split on the input axis): worker ``r`` holds the
  rows of ``A`` that its share of ``X`` meets, computes the partial product ``X_r A_r``, and
  ``Y = sum_r X_r A_r`` is **one all-reduce** (Megatron's ``g``). o_proj and down_proj are
  split this way.
* **Vocabulary-parallel** embedding (section 3, last paragraphs): worker ``r`` holds
  vocabulary rows ``[v_r, v_{r+1})``; a token's row comes from the worker that has it (the
  others give zeros) and one all-reduce makes it whole; ``lm_head`` (tied or not) splits
  the same way and the logits are all-gathered on the vocabulary axis.

Hugging Face checkpoints store ``A^T`` (``[out, in]``): a column-parallel split takes
**rows** of the stored tensor, a row-parallel split takes its **columns**. The table, for a
Llama-family layer with ``H`` hidden features, ``D`` head_dim, ``I`` intermediate
features, ``Hq``/``Hkv`` query/KV heads, and worker ``r`` owning query heads ``q_r``, KV
heads ``kv_r``, intermediate features ``i_r`` and vocabulary rows ``v_r``::

    tensor (HF name)                  stored        worker r keeps             kind
    model.embed_tokens.weight         [V, H]        rows v_r          [|v_r|, H]   vocab-parallel
    self_attn.q_proj.weight (+bias)   [Hq*D, H]     rows of heads q_r [|q_r|*D, H] column-parallel
    self_attn.k_proj / v_proj (+bias) [Hkv*D, H]    rows of heads kv_r [|kv_r|*D, H] column-parallel
    self_attn.o_proj.weight           [H, Hq*D]     columns of q_r    [H, |q_r|*D]  row-parallel, all-reduce
    mlp.gate_proj / up_proj           [I, H]        rows i_r          [|i_r|, H]    column-parallel
    mlp.down_proj.weight              [H, I]        columns i_r       [H, |i_r|]    row-parallel, all-reduce
    lm_head.weight (or the embedding) [V, H]        rows v_r          [|v_r|, H]    vocab-parallel, all-gather
    norms, per-head q_norm/k_norm     [H] or [D]    all (replicated)

Phi-3's fused ``qkv_proj`` ``[(Hq + 2 Hkv) D, H]`` and ``gate_up_proj`` ``[2 I, H]`` take
the same rows inside each of their parts.

**Heads.** A worker owns whole KV heads and the query heads that read them, so grouped-query
attention stays local. With at least as many KV heads as workers the KV heads are split
(as evenly as contiguous ranges go: SmolLM2's 3 KV heads over 2 workers give 1 and 2, with 3
and 6 query heads: vLLM refuses such uneven splits, this engine allows them because the
default model needs one); with fewer KV heads than workers each KV head is **replicated** on
``N / Hkv`` workers, each taking an equal share of its query heads (vLLM's rule, which then
needs ``N % Hkv == 0`` and ``Hq % N == 0``).

**Quantized weights.** Rows are quantized independently in every format, so row splits move
stored bytes (:meth:`refengine.quant.QuantizedWeight.take_rows`). A column split keeps the
stored form where its bounds fall on block boundaries
(:meth:`refengine.quant.QuantizedWeight.take_columns`: GGUF blocks, int8); otherwise (a
K-quant block of 256 cut at a head boundary, AWQ/GPTQ groups) that one tensor is kept
dequantized in float32 and a warning says so. Intermediate splits are aligned to 256
features where ``I`` allows, so down_proj's blocks stay whole.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from refengine.config import ModelConfig
from refengine.quant import is_quantized

logger = logging.getLogger(__name__)

#: Alignment tried for the intermediate split, largest first: a K-quant superblock, a
#: legacy GGUF block, any feature.
FFN_ALIGNMENTS = (256, 32, 1)


def split_evenly(n: int, parts: int, index: int, align: int = 1) -> range:
    """Part ``index`` of ``range(n)`` cut into ``parts`` contiguous ranges as even as units of
    ``align`` allow (the first ones get the smaller share: ``floor``); ``n % align == 0``."""
    units = n // align
    return range(index * units // parts * align, (index + 1) * units // parts * align)


@dataclass(frozen=True)
class Partition:
    """What tensor-parallel worker ``rank`` of ``world_size`` owns.

    Attributes:
        rank, world_size: this worker, of how many.
        q_heads: the query heads it computes (global indices).
        kv_heads: the KV heads it holds in its weights and KV cache (global indices).
        ffn: the MLP intermediate features it computes.
        vocab: the vocabulary rows of its embedding and ``lm_head`` share.
    """

    rank: int
    world_size: int
    q_heads: range
    kv_heads: range
    ffn: range
    vocab: range

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` as this worker's model sees it: its own head counts and intermediate size
        (``head_dim``, ``hidden_size`` and ``vocab_size`` unchanged)."""
        return dataclasses.replace(cfg, num_attention_heads=len(self.q_heads),
                                   num_key_value_heads=len(self.kv_heads), intermediate_size=len(self.ffn))


def plan_partitions(cfg: ModelConfig, world_size: int) -> list[Partition]:
    """Every worker's :class:`Partition` for ``tensor_parallel_size=world_size``.

    Raises:
        ValueError: more workers than query heads; with fewer KV heads than workers,
            ``world_size`` not a multiple of the KV heads or the query heads not a multiple
            of ``world_size``; the message names the counts.
    """
    n_q, n_kv, n = cfg.num_attention_heads, cfg.num_key_value_heads, world_size
    group = n_q // n_kv
    if n > n_q:
        raise ValueError(f"tensor_parallel_size={n} is more than the model's {n_q} attention heads: "
                         "every worker needs at least one head")
    if n_kv < n and (n % n_kv or n_q % n):
        raise ValueError(f"tensor_parallel_size={n} with {n_kv} KV heads and {n_q} attention heads: with fewer KV "
                         f"heads than workers, tensor_parallel_size must be a multiple of the KV heads ({n_kv}) and "
                         f"divide the attention heads ({n_q})")
    align = next(a for a in FFN_ALIGNMENTS if cfg.intermediate_size % a == 0 and cfg.intermediate_size // a >= n)
    parts = []
    for r in range(n):
        if n_kv >= n:  # split the KV heads; each worker takes their query groups
            kv = split_evenly(n_kv, n, r)
            q = range(kv.start * group, kv.stop * group)
        else:  # replicate each KV head on n / n_kv workers, splitting its group's query heads
            q = split_evenly(n_q, n, r)
            kv = range(q.start // group, q.start // group + 1)
        parts.append(Partition(r, n, q, kv, split_evenly(cfg.intermediate_size, n, r, align),
                               split_evenly(cfg.vocab_size, n, r)))
    return parts


def _head_rows(heads: range, head_dim: int, offset: int = 0) -> np.ndarray:
    return np.arange(offset + heads.start * head_dim, offset + heads.stop * head_dim)


def row_indices(name: str, cfg: ModelConfig, part: Partition) -> np.ndarray | None:
    """The stored rows (output features) worker ``part`` keeps of layer tensor ``name`` (its
    name after ``model.layers.{i}.``), or None where the tensor is not split on rows."""
    D, n_q, n_kv, inter = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    ffn = np.arange(part.ffn.start, part.ffn.stop)
    if name.startswith("self_attn.q_proj."):
        return _head_rows(part.q_heads, D)
    if name.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return _head_rows(part.kv_heads, D)
    if name.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
        return ffn
    if name == "self_attn.qkv_proj.weight":  # Phi-3: [q | k | v] rows
        return np.concatenate([_head_rows(part.q_heads, D), _head_rows(part.kv_heads, D, n_q * D),
                               _head_rows(part.kv_heads, D, (n_q + n_kv) * D)])
    if name == "mlp.gate_up_proj.weight":  # Phi-3: [gate | up] rows
        return np.concatenate([ffn, inter + ffn])
    return None


def column_range(name: str, cfg: ModelConfig, part: Partition) -> range | None:
    """The stored columns (input features) worker ``part`` keeps of layer tensor ``name``,
    or None where the tensor is not split on columns."""
    if name == "self_attn.o_proj.weight":
        return range(part.q_heads.start * cfg.head_dim, part.q_heads.stop * cfg.head_dim)
    if name == "mlp.down_proj.weight":
        return part.ffn
    return None


def take_columns(matrix, cols: range, name: str):
    """Columns ``cols`` of a stored ``[out, in]`` matrix: a float array sliced, a quantized one
    in its stored form where the format allows it at those bounds, else float32 (logged)."""
    if not is_quantized(matrix):
        return np.ascontiguousarray(matrix[:, cols.start:cols.stop])
    try:
        return matrix.take_columns(cols.start, cols.stop)
    except (NotImplementedError, ValueError) as why:
        logger.warning("tensor parallelism: %s (%s) kept in float32 for this worker: %s", name, matrix.format, why)
        return np.ascontiguousarray(matrix.dequantize()[:, cols.start:cols.stop])


def shard_checkpoint(weights: dict, cfg: ModelConfig, part: Partition) -> dict:
    """Worker ``part``'s share of a checkpoint (HF names -> ``[out, in]`` arrays or quantized
    weights, as :func:`refengine.formats.loader.load_weights` returns them), by the module table.

    The dict is consumed (emptied) so the full tensors can be freed as their shares are
    taken. Returns a new dict with the same names.
    """
    out = {}
    for full in list(weights):
        tensor = weights.pop(full)
        if full in ("model.embed_tokens.weight", "lm_head.weight"):
            out[full] = _take_rows(tensor, np.arange(part.vocab.start, part.vocab.stop))
            continue
        name = full.split(".", 3)[3] if full.startswith("model.layers.") else full
        rows, cols = row_indices(name, cfg, part), column_range(name, cfg, part)
        if rows is not None:
            tensor = _take_rows(tensor, rows)
        elif cols is not None:
            tensor = take_columns(tensor, cols, full)
        out[full] = tensor
    return out


def _take_rows(tensor, rows: np.ndarray):
    if is_quantized(tensor):
        return tensor.take_rows(rows)
    return np.ascontiguousarray(np.asarray(tensor)[rows])


class TensorParallelShard:
    """What a worker's model needs at run time: its :class:`Partition` and a communicator
    (:mod:`refengine.parallel.communicator`). The model calls it only when it runs as a
    shard (:attr:`refengine.models.llama.LlamaForCausalLM.tp` is None in one process)."""

    def __init__(self, partition: Partition, communicator):
        self.partition = partition
        self.comm = communicator

    def all_reduce(self, x):
        """``sum`` over workers of a row-parallel product's partial ``x [T, hidden]`` float32."""
        return self.comm.all_reduce(x)

    def embedding(self, lookup, input_ids, xp):
        """Vocabulary-parallel lookup: ``input_ids [T]`` -> ``[T, hidden]`` float32, each row
        from the worker that holds it (``lookup(local ids)`` gives this worker's rows), the
        others' zeros, summed by one all-reduce."""
        v = self.partition.vocab
        ids = xp.asarray(input_ids) - v.start
        mine = (ids >= 0) & (ids < len(v))
        rows = lookup(xp.where(mine, ids, 0))
        return self.comm.all_reduce(xp.where(mine[:, None], rows, xp.float32(0)))  # zeros: the sum needs every row

    def gather_logits(self, logits):
        """This worker's vocabulary columns ``[S, |v_r|]`` -> the whole ``[S, vocab]`` float32."""
        return self.comm.all_gather(logits)
