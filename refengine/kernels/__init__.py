"""refengine's hand-written CUDA kernels (``cuda/*.cu``) seen from Python.

* :mod:`refengine.kernels.plans`: the launch plan of each kernel (grid, block, shared
  memory, arguments) and the geometry constants that mirror the sources;
* :mod:`refengine.kernels.build`: the NVRTC program, the g++ emulator build, and the
  launcher objects (CuPy on a GPU, the strict emulator on the CPU) that run a plan.

The users are :mod:`refengine.attention.cuda` (attention) and :mod:`refengine.ops.cuda`
(RMSNorm, RoPE, SiLU-and-mul); they share one compiled module per device.
"""
