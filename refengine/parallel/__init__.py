"""Tensor parallelism: one model split over worker processes (Megatron-LM, section 3).

* :mod:`refengine.parallel.tensor_parallel`: which share of every weight a worker holds
  (the split table, with shapes), :class:`Partition`, :func:`plan_partitions`,
  :func:`shard_checkpoint`, and :class:`TensorParallelShard` (what the model calls).
* :mod:`refengine.parallel.communicator`: all-reduce and all-gather over MPI (``mpi4py``,
  CPU) or NCCL (``cupy.cuda.nccl``, GPU).
* :mod:`refengine.core.executor`: the driver-side runner; :mod:`refengine.core.worker`:
  the worker processes (started by ``mpiexec``).

Data-parallel replicas (many engines behind one endpoint) are :mod:`refengine.server.ray_serve`.
"""

from refengine.parallel.tensor_parallel import (Partition, TensorParallelShard, plan_partitions,
                                                shard_checkpoint)

__all__ = ["Partition", "TensorParallelShard", "plan_partitions", "shard_checkpoint"]
