"""Fine-tuning MHLA-converted diffusers transformers with accelerate (see recipes/train.py).

Each module has one job: config (recipe files and overrides), data (image/video/latent
datasets), conditioning (VAE and text encoders), objectives (DDPM+VLB, flow matching),
model (loading, conversion, what trains), distill (teacher), checkpoint (resume), validation.
"""
