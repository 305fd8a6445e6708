"""`eval fid`: generate N samples (spread over processes with accelerate, resumable), then FID.

Each process makes its share of the missing samples; the main process then reads all samples
from disk and computes FID alone, so no metric state has to be synchronised.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from . import fid as fidlib
from . import images, inception
from ..persistence import dtype_name
from .sampling import SamplingSettings, family_name, generate, load_pipeline
from .store import SampleStore


def generate_missing(pipe, store: SampleStore, todo: list[int], settings: SamplingSettings, batch_size: int, state) -> None:
    """Make this process's share of the samples `todo` (the same list on every process)."""
    with state.split_between_processes(todo) as mine:
        bar = tqdm(total=len(mine), desc=f"sampling [{state.process_index}]", unit="sample", disable=not state.is_local_main_process)
        for start in range(0, len(mine), batch_size):
            chunk = mine[start:start + batch_size]
            for i, sample in zip(chunk, generate(pipe, chunk, settings)):
                store.save(i, sample)
            bar.update(len(chunk))
        bar.close()


def run_fid(model, reference, out, num_samples: int, settings: SamplingSettings, *, batch_size: int = 8,
            fid_batch_size: int = 50, torch_dtype=None, feature=None, inception_weights=None,
            max_unreadable: float = images.MAX_UNREADABLE) -> dict | None:
    """Samples in `out`/samples, FID against `reference`, report in `out`/fid.json (main process);
    up to `max_unreadable` of a reference folder's files may be unreadable (skipped, reported)."""
    from accelerate import PartialState

    fidlib.check_count(num_samples, "the generated set")
    if not Path(reference).exists():
        raise FileNotFoundError(f"reference {reference} not found: give an image folder or an .npz with mu and sigma")
    if feature is None:
        inception_weights = inception.weights_path(inception_weights)  # fail before hours of sampling
    state = PartialState()
    out = Path(out)
    store = SampleStore(out / "samples")
    pinned = {"model": str(Path(model).resolve()), "dtype": str(torch_dtype), **settings.to_dict()}  # as pinned by earlier runs
    if state.is_main_process:
        store.pin_settings(pinned)
    state.wait_for_everyone()
    store.pin_settings(pinned)

    t0 = time.perf_counter()
    pipe = load_pipeline(model, torch_dtype).to(state.device)
    pipe.set_progress_bar_config(disable=True)
    family = family_name(pipe)
    t_load = time.perf_counter()
    todo = store.missing(num_samples)
    state.wait_for_everyone()  # every process splits the same list before any writes
    generate_missing(pipe, store, todo, settings, batch_size, state)
    t_gen = time.perf_counter()
    state.wait_for_everyone()
    if not state.is_main_process:
        return None
    paths = store.image_paths(num_samples)
    unreadable = images.UnreadableFiles(max_unreadable)
    value, n_ref = fidlib.fid(paths, reference, feature, inception_weights, fid_batch_size, progress=True, device=state.device,
                              unreadable=unreadable)
    t_fid = time.perf_counter()
    report = {
        "fid": value,
        "num_samples": num_samples,
        "num_images": len(paths),
        "model": str(model),
        "family": family,
        "reference": str(reference),
        "reference_n": n_ref,
        "reference_unreadable": len(unreadable.paths),
        "reference_unreadable_files": [str(p) for p in list(unreadable.paths)[:images.NAMED]],
        "feature": "inception-v3 2048-d (torch-fidelity weights)" if feature is None else type(feature).__name__,
        "settings": {**settings.to_dict(), "batch_size": batch_size, "dtype": dtype_name(torch_dtype), "num_processes": state.num_processes},
        "timings_s": {"load": t_load - t0, "sampling": t_gen - t_load, "fid": t_fid - t_gen, "total": t_fid - t0},
        "samples_made": len(todo),
        "samples_resumed": num_samples - len(todo),
        "samples_dir": str(store.root),
    }
    (out / "fid.json").write_text(json.dumps(report, indent=2))
    return report
