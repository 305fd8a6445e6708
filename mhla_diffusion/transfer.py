"""Layer-local attention transfer: fit each converted layer to the softmax layer it replaces.

The original model samples along its own trajectories while forward hooks keep, per self-attention
layer, a seeded reservoir of its calls (inputs and softmax outputs). Each layer's MHLA parameters
(mixing logits, output norm and gate; optionally also its q/k/v/out projections) are then fitted on
those pairs alone, in fp32 on a copy of that one layer: no backward through the model, no dataset,
one layer in memory at a time. The teacher stays unconverted until every layer is fitted; then the
model is converted and the fitted layers are written into it.
"""

from __future__ import annotations

import contextlib
import copy
import random
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .conversion import attn_processors, convert, new_processor, resolve_config, set_attn_processor, transformers_of
from .families import family_of, self_attentions, token_grid
from .processors import TokenGrid


@dataclass
class Call:
    """One call of a self-attention layer: its arguments and the softmax output, on the CPU."""

    args: tuple
    kwargs: dict
    output: torch.Tensor
    grid: tuple

    @property
    def nbytes(self) -> int:
        """The CPU memory it holds (`--layers-per-pass` bounds the kept calls' total)."""
        sizes = []
        _map((self.args, self.kwargs, self.output), lambda t: sizes.append(t.nbytes))
        return sum(sizes)


@dataclass
class LayerFit:
    """How well one converted layer matches its softmax original (relative MSE over its calls)."""

    name: str
    before: float  # right after conversion
    after: float  # after fitting
    curve: list = field(default_factory=list)  # training loss per step


def _map(obj, fn):
    """`fn` on every tensor of nested tuples, lists and dicts (diffusers passes RoPE as a tuple)."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def layer_key(component: str, path: str) -> str:
    """A self-attention layer's name across the transformers of a pipeline: "transformer_2/blocks.3.attn1"."""
    return f"{component}/{path}" if component else path


@contextlib.contextmanager
def record_self_attention(models: dict, keep: int, seed: int = 0, only=None):
    """Hooks on the self-attention layers of `models` (by component name; `only`: these layer keys)
    that keep a uniform reservoir of at most `keep` calls per layer. Yields {layer key: [Call, ...]}."""
    calls, seen, rngs, handles = {}, {}, {}, []
    cpu = lambda t: t.detach().cpu()  # noqa: E731

    for component, model in models.items():
        grid = TokenGrid()

        def publish(module, args, kwargs, grid=grid):
            grid.grid = token_grid(module, args[0] if args else kwargs["hidden_states"])

        handles.append(model.register_forward_pre_hook(publish, with_kwargs=True))
        names = {id(m): n for n, m in model.named_modules()}
        for attn in self_attentions(model):
            key = layer_key(component, names[id(attn)])
            if only is not None and key not in only:
                continue
            calls[key], seen[key] = [], 0
            rngs[key] = random.Random(f"{seed}/{key}")  # per layer: the same calls whichever layers share a pass

            def record(module, args, kwargs, output, key=key, grid=grid):
                seen[key] += 1
                slot = len(calls[key]) if len(calls[key]) < keep else rngs[key].randrange(seen[key])
                if slot < keep:
                    call = Call(_map(args, cpu), _map(kwargs, cpu), cpu(output), grid.grid)
                    calls[key][slot:slot + 1] = [call]

            handles.append(attn.register_forward_hook(record, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _relative_error(layer, calls, device) -> float:
    with torch.no_grad():
        errs = [_loss(layer, call, device).item() for call in calls]
    return sum(errs) / len(errs)


def _loss(layer, call: Call, device) -> torch.Tensor:
    """Relative MSE of the layer's output against the softmax output of one recorded call."""
    def to(t):  # a copy outside inference mode: the teacher recorded inference tensors
        return (t.to(device=device, dtype=torch.float32) if t.is_floating_point() else t.to(device)).clone()

    layer.processor.token_grid.grid = call.grid
    out = layer(*_map(call.args, to), **_map(call.kwargs, to))
    target = call.output.to(device=device, dtype=torch.float32)
    return (out - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-12)


def fitting(attn, processor, lr: float, projection_lr: float | None, device):
    """A float32 copy of `attn` with `processor`, and the Adam optimizer of what is fitted: the processor's
    parameters, with `projection_lr` also the layer's projections."""
    layer = copy.deepcopy(attn).to(device=device, dtype=torch.float32)
    layer.set_processor(processor.to(device=device, dtype=torch.float32))
    groups = [{"params": list(layer.processor.parameters()), "lr": lr}]
    projections = [p for n, p in layer.named_parameters() if not n.startswith("processor.")]
    for p in projections:
        p.requires_grad_(projection_lr is not None)
    if projection_lr is not None:
        groups.append({"params": projections, "lr": projection_lr})
    return layer, torch.optim.Adam(groups)


def fit_step(layer, optimizer, call: Call, device) -> float:
    """One optimizer step of a layer from `fitting` on one recorded call; its loss."""
    loss = _loss(layer, call, device)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def fit_layer(attn, processor, calls: list, steps: int, lr: float, projection_lr: float | None, device, seed: int = 0):
    """Fit `processor` (and, with `projection_lr`, the layer's projections) on a float32 copy of `attn`.

    Returns (the fitted layer copy, LayerFit without its name)."""
    layer, opt = fitting(attn, processor, lr, projection_lr, device)
    before = _relative_error(layer, calls, device)
    order = random.Random(seed)
    curve = [fit_step(layer, opt, calls[order.randrange(len(calls))], device) for _ in range(steps)]
    return layer, LayerFit("", before, _relative_error(layer, calls, device), curve)


def transfer(obj, config, run_teacher, keep: int, steps: int, lr: float, projection_lr: float | None = None,
             keep_softmax_worst: int = 0, layers_per_pass: int = 0, seed: int = 0, progress: bool = True) -> list[LayerFit]:
    """Convert `obj` (a pipeline or a transformer, unconverted) with `config` and fit every converted
    layer to the calls it gets while `run_teacher()` samples with the original model (the same
    samples each time it is called: e.g. a pipeline's seeded samples, evaluation.sampling.generate).

    layers_per_pass: record this many layers per `run_teacher()` pass (0: all in one pass), so memory
    is bounded at the price of sampling again. keep_softmax_worst: afterwards, the K layers that fit
    worst go back to softmax attention. Returns one LayerFit per converted layer, in layer order."""
    models = transformers_of(obj)
    device = next(iter(models.values())).device
    configs = {name: resolve_config(m, config) for name, m in models.items()}
    todo = {}  # layer key -> (component, module path, attention module), the layers to convert
    for name, m in models.items():
        names = {id(a): n for n, a in m.named_modules()}
        attns = self_attentions(m)
        for i in configs[name].converted_layers(len(attns)):
            todo[layer_key(name, names[id(attns[i])])] = (name, names[id(attns[i])], attns[i])
    keys = list(todo)
    passes = [keys[j:j + (layers_per_pass or len(keys))] for j in range(0, len(keys), layers_per_pass or len(keys))]
    fits, fitted = [], {}
    bar = tqdm(total=len(keys), desc="fitting layers", disable=not progress)
    for group in passes:
        with record_self_attention(models, keep, seed, only=set(group)) as calls:
            run_teacher()
        for key in group:
            name, _, attn = todo[key]
            if not calls[key]:
                raise ValueError(f"{key} was never called while sampling: nothing to fit it on")
            proc = new_processor(family_of(models[name]), attn, configs[name], TokenGrid())
            layer, fit = fit_layer(attn, proc, calls.pop(key), steps, lr, projection_lr, device,
                                   seed=seed + keys.index(key))
            fit.name = key
            fits.append(fit)
            fitted[key] = layer.state_dict()
            bar.update()
            bar.set_postfix(layer=key, before=f"{fit.before:.3g}", after=f"{fit.after:.3g}")
    bar.close()
    originals = {name: attn_processors(m) for name, m in models.items()}
    convert(obj, config)
    for key, (_, _, attn) in todo.items():
        attn.load_state_dict(fitted[key])  # cast to the model's dtype
    for fit in sorted(fits, key=lambda f: f.after)[len(fits) - keep_softmax_worst:] if keep_softmax_worst else []:
        name, path, _ = todo[fit.name]
        procs = attn_processors(models[name])
        procs[f"{path}.processor"] = originals[name][f"{path}.processor"]
        set_attn_processor(models[name], procs)
    return fits
