"""One tensor-parallel worker process: ``mpiexec -n N python -m refengine.core.worker HOST:PORT KEY_FILE``.

Started by :class:`refengine.core.executor.TensorParallelRunner`, never by hand: it reads
the key from ``KEY_FILE`` (a file only this user can read; the key itself is on no command
line), connects back to the driver (each proves to the other that it holds the key), says its
rank, receives its set-up, loads its share of the model and runs steps until told to stop
(:func:`worker_main`).
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Client
from pathlib import Path

from refengine.core.model_runner import ModelRunner
from refengine.parallel.tensor_parallel import TensorParallelShard, plan_partitions


def worker_main(conn, rank: int) -> None:
    """One tensor-parallel worker: load a share, then run steps until told to stop.

    Messages on ``conn`` (a ``multiprocessing.connection`` to the driver): it receives
    ``(nccl_id, config, dequantize_gguf, cpus)`` (on a GPU NCCL's unique id, else None; the
    resolved engine config; its cores); its rank and the world are MPI's;
    it sends
    ``("blocks", n)`` (GPU without ``num_kv_blocks``: what its share leaves room for) and
    expects the agreed config back, then ``("ready", info)``; after that each received
    ``(ids, positions, meta, rows)`` is one step, answered with the logits (worker 0) or None;
    ``None`` stops it. An exception is sent as ``("error", traceback text)`` before exiting.
    """
    comm = None
    try:
        nccl_id, config, dequantize_gguf, cpus = conn.recv()
        world_size = config.tensor_parallel_size
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        from refengine.core.engine import build_model, make_kv_cache, measure_gpu_kv_blocks

        partitions = plan_partitions(config.model_config, world_size)
        partition, widths = partitions[rank], [len(p.vocab) for p in partitions]
        if config.device == "cuda":
            import cupy

            from refengine.parallel.communicator import NcclCommunicator

            cupy.cuda.Device(rank).use()
            comm = NcclCommunicator(rank, world_size, nccl_id, widths)
        else:
            from refengine.parallel.communicator import MpiCommunicator

            comm = MpiCommunicator(widths)
        # on the CPU, this process's own process-wide settings (LayerOps.setup_runtime) first
        model = build_model(config, dequantize_gguf, partition, setup_runtime=config.device == "cpu")
        model.tp = TensorParallelShard(partition, comm)
        if config.num_kv_blocks is None:
            conn.send(("blocks", measure_gpu_kv_blocks(config, model)))
            config = conn.recv()
        kv_cache = make_kv_cache(config, model.config, model.xp)
        runner = ModelRunner(model, kv_cache)
        # every worker runs the same warm-up passes: their collectives pair up
        model.ops.warm_up(model, kv_cache, config.max_num_batched_tokens, config.max_model_len)
        formats = {name: getattr(getattr(model.layers[0], name), "format", "float")  # as stored, or float
                   for name in ("qkv", "o", "gate_up", "down")}
        conn.send(("ready", {"rank": rank, "pid": os.getpid(), "cpus": cpus, "q_heads": partition.q_heads,
                             "kv_heads": partition.kv_heads, "ffn": partition.ffn, "vocab": partition.vocab,
                             "layer0_formats": formats}))
        while (step := conn.recv()) is not None:
            logits = runner.run_model(*step)
            conn.send(logits if rank == 0 else None)
    except (EOFError, KeyboardInterrupt):
        pass  # the driver went away
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if comm is not None:
            comm.close()


def main(argv: list[str]) -> None:
    from mpi4py import MPI  # initializes MPI: this process's rank among mpiexec's

    rank = MPI.COMM_WORLD.Get_rank()
    address, key_file = argv
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=Path(key_file).read_bytes())
    conn.send_bytes(str(rank).encode())  # plain digits: the driver unpickles nothing before it knows us
    worker_main(conn, rank)
    conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
