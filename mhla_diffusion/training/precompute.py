"""Encode a dataset once (VAE posterior + text embeddings or labels) into a latent cache.

Training from the cache then skips the VAE and the text encoder. Every process of an
`accelerate launch` encodes its own slice (sample i goes to rank i % world), one
.safetensors file per sample named by its index; unreadable files are skipped and counted
(data.SkippedFiles: past max_unreadable of them, no cache.json is written and the run fails).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

from .. import persistence
from ..families import CLASS_NAMES, family_by_name
from . import conditioning
from .data import CACHE_INDEX, SkippedFiles, build_dataset, collate
from .train_config import check_family


class Readable(Dataset):
    """Samples `indices` of a raw dataset; an unreadable file yields {"unreadable": (index, error)}
    instead of a substitute."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, list(indices)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        index = self.indices[i]
        try:
            return {"index": index, **self.dataset.load(index)}
        except Exception as err:  # noqa: BLE001 - whatever the decoder raises, the file is skipped
            return {"unreadable": (index, str(err))}


def collate_readable(samples):
    good = [s for s in samples if "unreadable" not in s]
    batch = collate(good) if good else {}
    batch["unreadable"] = [s["unreadable"] for s in samples if "unreadable" in s]
    return batch


def precompute(config, out_dir, accelerator) -> dict:
    """Write this process's share of the cache; the main process writes cache.json at the end."""
    from diffusers import DiffusionPipeline

    index = DiffusionPipeline.load_config(config.pretrained)
    experts = [name for name, entry in index.items()
               if isinstance(entry, list) and entry[-1].removeprefix("MHLA") in CLASS_NAMES]  # an expert converted before
    family = family_by_name(index[config.component][1].removeprefix("MHLA"))
    pipe = persistence.load(config.pretrained, **dict.fromkeys(experts))  # no transformer is needed (Wan2.2 A14B has two)
    check_family(config, family, config.pretrained)
    data_type = "videos" if family.video else "images"
    dataset = build_dataset(data_type, config.data_dir, config.resolution, config.num_frames)
    out = Path(out_dir)
    if (out / CACHE_INDEX).exists():
        raise FileExistsError(f"{out} already holds a latent cache; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    device = accelerator.device
    pipe.vae.to(device)
    if family.text:
        pipe.text_encoder.to(device)
    shard = Readable(dataset, range(accelerator.process_index, len(dataset), accelerator.num_processes))
    loader = DataLoader(shard, batch_size=config.train_batch_size, num_workers=config.num_workers, collate_fn=collate_readable)
    written, skipped = 0, SkippedFiles(dataset, config.max_unreadable)
    for batch in loader:
        skipped.add(batch.pop("unreadable"))
        if not batch:
            continue
        encoded = conditioning.encode_batch(batch, pipe, family.text, config.max_sequence_length, device)
        for j, index in enumerate(batch["index"].tolist()):
            save_sample(out, index, {k: v[j] for k, v in encoded.items()})
            written += 1
    unreadable = skipped.sync(accelerator)
    samples = int(accelerator.reduce(torch.tensor(written, device=device), "sum"))
    return finish_cache(out, config, family.name, family.video,
                        conditioning.latent_shape(pipe.vae, config.resolution, config.num_frames, family.video),
                        accelerator, samples=samples, unreadable=unreadable)


def save_sample(out: Path, index: int, sample: dict) -> None:
    """One cache sample, written under a temporary name first: a sample file is complete or absent."""
    tmp = out / f".{index:09d}.partial"
    save_file({k: v.contiguous().cpu() for k, v in sample.items()}, str(tmp))
    os.replace(tmp, out / f"{index:09d}.safetensors")


def finish_cache(out: Path, config, family: str, video: bool, latent_shape, accelerator, **facts) -> dict:
    """Write cache.json, last, which marks the cache complete; returns what it holds."""
    info = {"family": family, "pretrained": str(config.pretrained), "resolution": list(config.resolution),
            "video": video, "latent_shape": list(latent_shape), **facts}
    if video:
        info["num_frames"] = config.num_frames
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (out / CACHE_INDEX).write_text(json.dumps(info, indent=1))
    accelerator.wait_for_everyone()
    return info
