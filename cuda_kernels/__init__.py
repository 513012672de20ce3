"""CUDA C sources of the GPU parity-delta kernels, installed as package data of ``ecrec.cuda_kernels``.

``ecrec.coding.kernels.gpu`` finds them with ``importlib.resources`` and compiles them at run time through
``cupy.RawModule``; nothing here is imported for its code.
"""
