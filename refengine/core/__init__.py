"""The core loop: the engine, the scheduler, the block manager, sequences, the model runner
and the executor that runs model runners in tensor-parallel worker processes."""
