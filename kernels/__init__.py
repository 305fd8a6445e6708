"""Fused Triton kernels for MHLA (installed as `mhla_diffusion.kernels`)."""
