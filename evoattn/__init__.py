"""evoattn: evolves fast CUDA and Triton attention kernels against PyTorch's SDPA."""
__version__ = "0.1.0"
