"""Where the 2048-d InceptionV3 weights of FID come from (no downloads during an evaluation)."""

from __future__ import annotations

from pathlib import Path

# torch-fidelity's port of the TF FID Inception (the network behind the published FIDs).
WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
WEIGHTS_URL = f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{WEIGHTS_FILE}"


def hub_weights() -> Path:
    """The path torch hub caches the weights under ($TORCH_HOME/hub/checkpoints/)."""
    import torch

    return Path(torch.hub.get_dir()) / "checkpoints" / WEIGHTS_FILE


def weights_path(path=None) -> Path:
    """`path` if given, else the torch hub cache; a clear FileNotFoundError if the file is absent."""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"Inception weights {path} not found; FID needs torch-fidelity's {WEIGHTS_FILE} ({WEIGHTS_URL})")
        return path
    cached = hub_weights()
    if not cached.is_file():
        raise FileNotFoundError(
            f"FID needs the InceptionV3 weights {WEIGHTS_FILE}: download {WEIGHTS_URL} and put it at {cached} "
            "(or pass --inception-weights PATH)"
        )
    return cached
