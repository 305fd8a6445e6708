"""One rank of the sequence-parallel check, launched by tests/test_sequence_parallel.py:

    torchrun --nproc_per_node P tests/sp_worker.py OUT.json

Each rank builds the same tiny converted model, runs one forward and backward in one process
(the reference), then again under context parallelism (gloo) on its token slice. Rank 0 writes
the relative errors of the output and of the rank-summed parameter and input gradients, and
the token counts each rank's first self-attention saw; the gradients again with gradient checkpointing.
"""

import sys

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig

import mhla_diffusion as md
from mhla_diffusion import zoo
from mhla_diffusion.context_parallel import enable_context_parallel
from mhla_diffusion.families import self_attentions

from ranks import finish
from test_convert import inputs

# family: (latent height x width, Wan frames, blocks, model overrides); token counts 175, 35, 25
# divide by neither 2 nor 3. Heads of 8 channels, not 2 or 4: with few channels relu(q) is often
# nearly 0, the normalized output's denominator nearly eps, and fp32 q-gradients ill-conditioned.
CASES = {
    "wan": ((10, 14), 5, (2, 2, 2), {}),
    "pixart": ((10, 14), 1, (2, 2), {"attention_head_dim": 8}),
    "dit": ((10, 10), 1, (2, 2), {"attention_head_dim": 8}),
}


def step(model, kwargs):
    """Output, parameter grads and input grad of one forward/backward of a fixed random projection."""
    x = kwargs["hidden_states"].clone().requires_grad_()
    out = model(**{**kwargs, "hidden_states": x}, return_dict=False)[0]
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads, x.grad


def rel(a, b, floor=0.0):
    """Max error relative to b's largest entry (or `floor`, for grads that are zero up to rounding)."""
    return ((a - b).abs().max() / max(b.abs().max().item(), floor)).item()


def check(family, world):
    size, frames, blocks, overrides = CASES[family]
    model = zoo.build_transformer(family, **overrides)
    md.convert(model, md.default_config(model, blocks=blocks))
    with torch.no_grad():  # mixing matrices away from their init, the same on every rank
        g = torch.Generator().manual_seed(1)
        for n, p in model.named_parameters():
            if ".mixing." in n:
                p.add_(torch.randn(p.shape, generator=g))
    kwargs = inputs(model, size, frames=frames)
    ref_out, ref_grads, ref_x = step(model, kwargs)

    seen = []
    record = lambda m, args, kw: seen.append((args[0] if args else kw["hidden_states"]).shape[1])  # noqa: E731
    self_attentions(model)[0].register_forward_pre_hook(record, with_kwargs=True)
    enable_context_parallel(model, ContextParallelConfig(ring_degree=world, ring_anything=True))
    out, grads, x_grad = step(model, kwargs)
    model.enable_gradient_checkpointing()  # the backward recomputes each block, all-reduce included
    ckpt_grads = step(model, kwargs)[1]
    for grad in [*grads.values(), *ckpt_grads.values(), x_grad]:  # replicated parameters: per-rank grads add up
        dist.all_reduce(grad)
    counts = [None] * world
    dist.all_gather_object(counts, seen)
    assert grads.keys() == ref_grads.keys()
    scale = max(g.abs().max().item() for g in ref_grads.values())
    return {
        "out": rel(out, ref_out),
        # grads under 1% of the model's largest are compared at that level: a softmax key bias, say, has
        # a zero gradient in exact arithmetic, so its fp32 gradient is rounding noise
        "grads": max(rel(grads[n], ref_grads[n], 1e-2 * scale) for n in ref_grads),
        "worst": sorted((rel(grads[n], ref_grads[n], 1e-2 * scale), n) for n in ref_grads)[-3:],
        "checkpointed_grads": max(rel(ckpt_grads[n], ref_grads[n], 1e-2 * scale) for n in ref_grads),
        "input_grad": rel(x_grad, ref_x),
        "tokens_seen": [c[0] for c in counts],
        "layer0_calls": [len(c) for c in counts],  # 3: the plain step, and the checkpointed one's forward and recompute
    }


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    finish({family: check(family, world) for family in CASES}, sys.argv[1])


if __name__ == "__main__":
    main()
