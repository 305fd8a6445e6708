"""Fine-tuning MHLA-converted diffusers transformers with accelerate (see recipes/train.py).

One module per job: config (recipe files and overrides), families (objective, conditioning
and transformer call per family), data (image/video/latent datasets), conditioning (VAE and
text encoder), objectives (DDPM + VLB, flow matching), model (load, convert, what trains,
save), distill (teacher), checkpoint (resume), validation (samples), precompute (latent cache),
sequence_parallel (context-parallel fine-tuning).
"""
