"""Distillation from the unconverted model: output MSE and per-layer self-attention output MSE.

The teacher is a frozen copy of the transformer taken *before* conversion, built with
`copy.deepcopy` whose memo maps every parameter the recipe leaves untouched to itself: those
tensors are shared with the student, not duplicated (only trained weights are copied).
Sharing needs plain data parallelism: under FSDP the student's parameters are resharded, so
the recipe refuses distillation there.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..families import self_attentions
from .objectives import model_output


def build_teacher(transformer, shared_ids: set[int], dtype=None):
    """Frozen copy of the (unconverted) `transformer` sharing the parameters in `shared_ids`."""
    memo = {pid: p for p in transformer.parameters() if (pid := id(p)) in shared_ids}
    teacher = copy.deepcopy(transformer, memo)
    for p in teacher.parameters():
        if id(p) not in shared_ids:
            p.requires_grad_(False)
            if dtype is not None:
                p.data = p.data.to(dtype)
    return teacher.eval()


def teacher_prediction(teacher, inputs: dict, uncond_inputs: dict | None = None, scale: float = 1.0) -> torch.Tensor:
    """The distillation target: the teacher's prediction at the student's `inputs`, or, given the unconditional
    inputs, guided as the pipelines guide: uncond + scale * (cond - uncond) on the predicted channels (those of
    the input; a learned variance beyond them stays the conditional one, which the pipelines discard). The
    unconditional pass runs first, so an AttentionTap on the teacher keeps the pass the student also ran."""
    if uncond_inputs is None:
        return model_output(teacher(**inputs, return_dict=False))
    uncond = model_output(teacher(**uncond_inputs, return_dict=False))
    cond = model_output(teacher(**inputs, return_dict=False))
    c = inputs["hidden_states"].shape[1]
    return torch.cat([uncond[:, :c] + scale * (cond[:, :c] - uncond[:, :c]), cond[:, c:]], dim=1)


class AttentionTap:
    """Keeps the latest output of each listed self-attention layer (forward hooks on `attn1`) in a forward pass.

    Not in the backward: gradient checkpointing runs each block's forward again there, and keeping those
    outputs would keep every block's recomputed activations alive to the end of the backward (60 GiB more
    for Wan2.1-1.3B at 480p x 81)."""

    def __init__(self, transformer, layers: list[int]):
        self.outputs: dict[int, torch.Tensor] = {}
        attns = self_attentions(transformer)
        self.handles = [attns[i].register_forward_hook(self._keep(i)) for i in layers]

    def _keep(self, i):
        def hook(module, args, output):
            if torch._C._current_graph_task_id() == -1:  # -1: no backward running (what torch's checkpoint asks too)
                self.outputs[i] = output[0] if isinstance(output, tuple) else output
        return hook


def distill_loss(student_out, teacher_out, student_tap: AttentionTap | None, teacher_tap: AttentionTap | None,
                 w_output: float, w_layers: float) -> dict:
    """{'distill_output': ..., 'distill_layers': ...} for the terms with non-zero weight (already weighted)."""
    terms = {}
    if w_output:
        terms["distill_output"] = w_output * F.mse_loss(student_out.float(), teacher_out.float())
    if w_layers:
        pairs = [(student_tap.outputs[i], teacher_tap.outputs[i]) for i in teacher_tap.outputs]
        terms["distill_layers"] = w_layers * torch.stack([F.mse_loss(s.float(), t.float()) for s, t in pairs]).mean()
    return terms
