"""What the Triton kernels can compute, declared for the op's backend dispatch (`mhla_diffusion.ops.dispatch`).

Plain values, no triton import: the dispatch reads them on every call, on machines without a GPU too.
"""

import torch

DEVICE = "cuda"  # and any device under TRITON_INTERPRET=1 (Triton's CPU interpreter, for tests)
# Triton supports NVIDIA GPUs from Ampere on (its README); compiled for Turing (sm_75) most kernels here outgrow its
# 64 KB of shared memory even at the smallest settings `fitting.smaller` steps down to
MIN_CAPABILITY = (8, 0)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # q, k, v share one of them
FEATURES = ("relu", "elu")  # the feature maps `mhla._phi` computes (elu: elu + 1)
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256  # D and D_v
# 16-bit tensor-core products need K >= 16 on NVIDIA GPUs (the interpreter takes any): D, D_v of 8 compile in fp32 only.
MIN_HEAD_DIM_16BIT = 16
# `mhla._raster` divides in fp32: exact for token ranks inside a block below this.
MAX_BLOCK_TOKENS = 2**21
