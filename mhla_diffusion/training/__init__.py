"""Fine-tuning MHLA-converted diffusers transformers with accelerate (see recipes/train.py).

One module per job: train_config (recipe files and overrides), data (image/video/latent
datasets), conditioning (VAE and text encoder), objectives (DDPM + VLB, flow matching), model
(load, convert, what trains, save), distill (teacher), checkpoint (resume), validation
(samples), precompute and teacher_cache (latent caches), context_parallel (context-parallel
fine-tuning). What differs per model family (objective, conditioning, the transformer call)
is the family's (`mhla_diffusion.families`).
"""
