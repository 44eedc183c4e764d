"""Collectives between tensor-parallel workers, from well-kept libraries.

Two operations are all tensor parallelism needs (:mod:`refengine.parallel.tensor_parallel`):
``all_reduce`` (sum a row-parallel product's partials) and ``all_gather`` (the vocabulary
shares of the logits). Each communicator does them in float32 on the arrays the model
computes with:

* :class:`MpiCommunicator` (CPU, NumPy arrays): MPI through ``mpi4py``, with the MPICH
  that the ``mpich`` wheel brings (its shared-memory transport between processes of one
  machine, its network ones between machines). Chosen over gloo (``torch.distributed``),
  whose loopback TCP is far slower for the small all-reduces of decode, two per layer
  (``docs/distributed.md``; figures in ``docs/PERFORMANCE.md``, "Design notes"). The workers are started by
  MPI's own launcher, ``mpiexec``, which gives them their ranks.
* :class:`NcclCommunicator` (GPU, CuPy arrays): NCCL through ``cupy.cuda.nccl``, on the
  current stream, as vLLM's ``PyNcclCommunicator`` does. One GPU per worker (NCCL refuses two
  ranks on one device).

With ``tensor_parallel_size=1`` no communicator exists and the model makes no calls.
"""

from __future__ import annotations

import numpy as np


def _pad_to(x, width: int, xp):
    """``x [S, w]`` -> ``[S, width]`` (zeros on the right), for equal all-gather sizes."""
    if x.shape[1] == width:
        return x
    out = xp.zeros((x.shape[0], width), dtype=x.dtype)
    out[:, :x.shape[1]] = x
    return out


class MpiCommunicator:
    """``MPI_COMM_WORLD`` of the processes ``mpiexec`` started (``mpi4py``).

    Args:
        widths: every rank's share of the last axis that :meth:`all_gather` joins (the
            vocabulary split, which may be uneven by one).
    """

    def __init__(self, widths: list[int]):
        from mpi4py import MPI

        self._mpi, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.world_size, self.widths = self.comm.Get_rank(), self.comm.Get_size(), list(widths)

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The elementwise sum over ranks of ``x`` (float32, any shape), in place where ``x`` is
        C-contiguous float32 (returned either way)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.comm.Allreduce(self._mpi.IN_PLACE, x, op=self._mpi.SUM)
        return x

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        """Every rank's ``x [S, widths[rank]]`` joined on the last axis: ``[S, sum(widths)]`` float32."""
        mine = _pad_to(np.ascontiguousarray(x, dtype=np.float32), max(self.widths), np)
        out = np.empty((self.world_size, *mine.shape), dtype=np.float32)
        self.comm.Allgather(mine, out)
        return np.concatenate([out[r, :, :w] for r, w in enumerate(self.widths)], axis=1)

    def close(self) -> None:
        pass  # MPI finalizes itself when the process exits (mpi4py's atexit)


class NcclCommunicator:
    """NCCL (``cupy.cuda.nccl``) between ``world_size`` processes, one GPU each.

    Args:
        rank, world_size: this process, of how many.
        unique_id: ``cupy.cuda.nccl.get_unique_id()``, made once by the driver and given to
            every rank.
        widths: as :class:`MpiCommunicator`.
    """

    def __init__(self, rank: int, world_size: int, unique_id, widths: list[int]):
        import cupy
        from cupy.cuda import nccl

        self._cp, self._nccl = cupy, nccl
        self.comm = nccl.NcclCommunicator(world_size, unique_id, rank)
        self.rank, self.world_size, self.widths = rank, world_size, list(widths)

    def all_reduce(self, x):
        """The elementwise sum over ranks of ``x`` (a CuPy array), float32, in place where
        ``x`` is C-contiguous float32."""
        cp, nccl = self._cp, self._nccl
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                            cp.cuda.get_current_stream().ptr)
        return x

    def all_gather(self, x):
        """Every rank's ``x [S, widths[rank]]`` joined on the last axis: ``[S, sum(widths)]`` float32."""
        cp, nccl = self._cp, self._nccl
        mine = _pad_to(cp.ascontiguousarray(x, dtype=cp.float32), max(self.widths), cp)
        out = cp.empty((self.world_size, *mine.shape), dtype=cp.float32)
        self.comm.allGather(mine.data.ptr, out.data.ptr, mine.size, nccl.NCCL_FLOAT32,
                            cp.cuda.get_current_stream().ptr)
        return cp.concatenate([out[r, :, :w] for r, w in enumerate(self.widths)], axis=1)

    def close(self) -> None:
        self.comm.destroy()
