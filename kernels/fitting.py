"""Launch settings the card takes: the kernels' settings were tuned on an H200, whose programs may opt into 227 KB of
shared memory; an A100 gives them 163 KB and an RTX 3090, 4090, 5090, A10, L4 or L40S 99 KB, and refuses the deeper
pipelines and wider tiles (a converted Wan's key gradients asked 144 KB: `tests/test_kernels.py` compiles every
kernel for sm_89). Triton refuses such a launch with `OutOfResources` before anything runs, so a launcher retries
with smaller settings, as Triton's autotuner prunes configs, and remembers what the card took.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from typing import Callable, Iterator, TypeVar

from triton.runtime.errors import OutOfResources

log = logging.getLogger(__name__)
T = TypeVar("T")
SMALLEST_TILE = 16  # tensor-core products need 16 rows
# (kernel, device, settings asked, the launch's other constexprs) -> the step of `smaller` a refusal led to
_TAKEN: dict = {}
_stepping = True  # off inside `as_asked`


def smaller(settings: dict, tiles: tuple[str, ...]) -> Iterator[dict]:
    """`settings`, then with one pipeline stage fewer down to one, then at one stage with each of the `tiles` entries
    in turn halved down to SMALLEST_TILE (the ones before it held there): the order in which the settings give back
    shared memory (stages first: each holds another copy of the walked tiles, which the deep pipelines spend it on)."""
    yield settings
    for stages in range(settings["num_stages"] - 1, 0, -1):
        yield {**settings, "num_stages": stages}
    held = {"num_stages": 1}
    for tile in tiles:
        size = settings[tile] // 2
        while size >= SMALLEST_TILE:
            yield {**settings, **held, tile: size}
            size //= 2
        held[tile] = min(settings[tile], SMALLEST_TILE)


def launch_within_card(kernel, device, settings: dict, tiles: tuple[str, ...], constexprs: dict,
                       launch: Callable[[dict], T]) -> T:
    """`launch(settings)`, or where the card refuses its shared memory, `launch` of the first of `smaller(settings,
    tiles)` it takes; `launch` derives the grid, tiles and buffers from the settings it is given. `constexprs` are the
    launch's other compile-time values that size shared memory: a later call with the same kernel, device, settings
    and constexprs starts from the step the card last took (only ever a smaller one; a key coarser than the compile's
    costs speed, never a wrong launch). Raises the card's refusal of the smallest settings."""
    if not _stepping:
        return launch(settings)
    key = _key(kernel, device, settings, constexprs) if _TAKEN else None  # no refusal yet (an H200): no key to build
    step = _TAKEN.get(key, 0)
    candidates = list(smaller(settings, tiles)) if step else [settings]
    while True:
        try:
            return launch(candidates[step])
        except OutOfResources as refusal:
            # the refused attempt's buffers go now: Triton's raise leaves a cycle through its frames, which held them
            # until the next garbage collection
            traceback.clear_frames(refusal.__traceback__)
            if len(candidates) == 1:
                candidates = list(smaller(settings, tiles))
            if step + 1 == len(candidates):
                raise
            step += 1
            _TAKEN[key or _key(kernel, device, settings, constexprs)] = step
            log.info("%s on %s: %s needs %s bytes of shared memory, the card has %s; trying %s",
                     getattr(kernel, "__name__", kernel), device, candidates[step - 1], refusal.required,
                     refusal.limit, candidates[step])


def _key(kernel, device, settings: dict, constexprs: dict) -> tuple:
    return kernel, str(device), tuple(sorted(settings.items())), tuple(sorted(constexprs.items()))


@contextlib.contextmanager
def as_asked():
    """Launches with exactly the settings asked, refused where the card refuses them: a launch-settings sweep
    (`tune.py`) must time the candidate it names, not a smaller one. A process-wide switch (not per thread)."""
    global _stepping
    _stepping = False
    try:
        yield
    finally:
        _stepping = True


@contextlib.contextmanager
def card_with_shared_memory(limit: int):
    """Triton's JIT refuses, as a card with `limit` bytes of shared memory per program would, every launch that needs
    more (it reads the card's limit through `triton.compiler.compiler.max_shared_mem`): on a larger card, the
    settings the launchers step down to can be checked and timed (`bench op --shared-memory`)."""
    from triton.compiler import compiler

    card = compiler.max_shared_mem
    compiler.max_shared_mem = lambda device: min(card(device), limit)
    try:
        yield
    finally:
        compiler.max_shared_mem = card
