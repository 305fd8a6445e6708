"""Training datasets: image folders, video folders, and precomputed latent caches.

Layouts (captions follow the Hugging Face imagefolder convention, `metadata.jsonl` with
`file_name` and `text`):
  images, class-conditional:  root/<class name>/*.png|jpg|...   (labels = sorted class names)
  images, text-to-image:      root/metadata.jsonl + the files it names
  videos:                     root/metadata.jsonl naming .mp4 files or folders of frames
  latents:                    root/cache.json + one .safetensors per sample (recipes/precompute.py)

A file that cannot be read is replaced by the next readable sample and named in the sample's
"skipped" field, so one bad file among millions neither stops a run nor changes batch shapes;
the loop counts each file once over epochs and processes (`SkippedFiles`, the rule of
evaluation.images.UnreadableFiles) and stops past `max_unreadable` of the files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..evaluation.images import UnreadableFiles

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
VIDEO_EXTS = {".mp4", ".webm", ".mov", ".mkv", ".avi"}
METADATA = "metadata.jsonl"
CACHE_INDEX = "cache.json"
MAX_SKIP = 64  # consecutive unreadable files before a dataset is declared broken


def resize_center_crop(img: Image.Image, size) -> Image.Image:
    """Resize so the image covers `size` (h, w), then crop the centre (DiT/ADM preprocessing)."""
    h, w = size
    scale = max(h / img.height, w / img.width)
    img = img.resize((max(w, round(img.width * scale)), max(h, round(img.height * scale))), Image.BICUBIC)
    left, top = (img.width - w) // 2, (img.height - h) // 2
    return img.crop((left, top, left + w, top + h))


def to_tensor(img: Image.Image) -> torch.Tensor:
    """(3, H, W) float in [-1, 1]."""
    arr = np.asarray(img.convert("RGB"), dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def read_metadata(root: Path) -> list[dict]:
    rows = []
    for n, line in enumerate((root / METADATA).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append({"file": row["file_name"], "caption": str(row.get("text", ""))})
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{root / METADATA}, line {n}: expected a JSON object with 'file_name' and 'text'") from None
    return rows


class SkippingDataset(Dataset):
    """Base: `load(i)` may raise; `__getitem__` then moves on to the next sample and names the
    skipped ones as (index, error) in "skipped" (data loader workers cannot share a tally)."""

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        skipped = []
        for attempt in range(min(MAX_SKIP, len(self.items))):
            i = (index + attempt) % len(self.items)
            try:
                return {**self.load(i), "skipped": skipped}
            except Exception as err:  # noqa: BLE001 - any unreadable file is skipped, whatever the decoder raises
                skipped.append((i, str(err)))
        raise ValueError(f"{len(skipped)} unreadable files in a row from {self.items[index]['file']}: check the data in {self.root}")


class SkippedFiles:
    """The unreadable files that all processes met, each counted once (a file comes back every
    epoch, and to every rank of a context-parallel group); past `limit` of the files, an error."""

    def __init__(self, dataset, limit: float):
        self.dataset, self.new = dataset, []
        self.files = UnreadableFiles(limit, "--max_unreadable")

    def add(self, skipped: list) -> None:
        self.new += skipped

    def sync(self, accelerator) -> int:
        """Pool what every process met since the last call (collective); the count so far."""
        from accelerate.utils import gather_object

        met, self.new = gather_object(self.new), []
        for i, err in met:
            self.files.add(self.dataset.items[i]["file"], err, len(self.dataset))
        return len(self.files.paths)


class ImageFolder(SkippingDataset):
    """Images with class subfolders (labels) or metadata.jsonl (captions)."""

    def __init__(self, root, resolution):
        self.root, self.size = Path(root), tuple(resolution)
        if (self.root / METADATA).is_file():
            self.items = [{"file": self.root / r["file"], "caption": r["caption"]} for r in read_metadata(self.root)]
            self.classes = None
        else:
            self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir())
            self.items = [{"file": f, "class_label": c} for c, name in enumerate(self.classes)
                          for f in sorted((self.root / name).iterdir()) if f.suffix.lower() in IMAGE_EXTS]
        if not self.items:
            raise ValueError(f"no images in {self.root}: expected class subfolders of images or a {METADATA} with captions")

    def load(self, i):
        item = self.items[i]
        with Image.open(item["file"]) as img:
            pixels = to_tensor(resize_center_crop(img, self.size))
        return {"pixels": pixels, **{k: v for k, v in item.items() if k != "file"}}


def read_video_frames(path: Path, num_frames: int) -> list[Image.Image]:
    """The first `num_frames` frames of an mp4 (via PyAV) or of a folder of images."""
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.suffix.lower() in IMAGE_EXTS)[:num_frames]
        frames = []
        for f in files:
            with Image.open(f) as img:
                frames.append(img.convert("RGB"))
    else:
        import av  # optional dependency of the `train` extra: only video files need it

        with av.open(str(path)) as container:
            frames = []
            for frame in container.decode(video=0):
                frames.append(frame.to_image())
                if len(frames) == num_frames:
                    break
    if len(frames) < num_frames:
        raise ValueError(f"has {len(frames)} frames, fewer than num_frames={num_frames}")
    return frames


class VideoFolder(SkippingDataset):
    """Captioned clips: (3, F, H, W) in [-1, 1] from mp4 files or folders of frames."""

    def __init__(self, root, resolution, num_frames):
        self.root, self.size, self.num_frames = Path(root), tuple(resolution), num_frames
        if not (self.root / METADATA).is_file():
            raise ValueError(f"{self.root} has no {METADATA}: a video folder needs one line per clip, "
                             '{"file_name": "clip.mp4" or "frames_dir", "text": "caption"}')
        self.items = [{"file": self.root / r["file"], "caption": r["caption"]} for r in read_metadata(self.root)]
        if not self.items:
            raise ValueError(f"{self.root / METADATA} lists no clips")

    def load(self, i):
        item = self.items[i]
        frames = read_video_frames(item["file"], self.num_frames)
        pixels = torch.stack([to_tensor(resize_center_crop(f, self.size)) for f in frames], dim=1)
        return {"pixels": pixels, "caption": item["caption"]}


class LatentCache(Dataset):
    """Samples written by `precompute`: VAE posterior (mean, std) and text embeddings or labels."""

    def __init__(self, root):
        from safetensors.torch import load_file

        self.root = Path(root)
        self.info = read_cache_info(self.root)
        self.files = sorted(self.root.glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"latent cache {self.root} holds no .safetensors samples")
        self._load = load_file

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        sample = self._load(str(self.files[i]))
        if "class_label" in sample:
            sample["class_label"] = int(sample["class_label"])
        sample["skipped"] = []
        return sample


def read_cache_info(root: Path) -> dict:
    path = Path(root) / CACHE_INDEX
    if not path.is_file():
        raise ValueError(f"{root} is not a latent cache (no {CACHE_INDEX}); create one with recipes/precompute.py")
    return json.loads(path.read_text())


def detect_data_type(data_dir, video: bool) -> str:
    """'latents' for a cache, else 'videos' for video families and 'images' otherwise."""
    if (Path(data_dir) / CACHE_INDEX).is_file():
        return "latents"
    return "videos" if video else "images"


def build_dataset(data_type: str, data_dir, resolution, num_frames):
    root = Path(data_dir)
    if not str(data_dir) or not root.is_dir():
        raise FileNotFoundError(f"data_dir {str(data_dir)!r} is not a directory")
    if data_type == "latents":
        return LatentCache(root)
    if data_type == "videos":
        return VideoFolder(root, resolution, num_frames)
    return ImageFolder(root, resolution)


def collate(samples: list[dict]) -> dict:
    """Stack tensors, keep captions as a list, join the lists of skipped files."""
    batch = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if key == "skipped":
            batch[key] = sum(values, [])
        elif isinstance(values[0], torch.Tensor):
            batch[key] = torch.stack(values)
        elif isinstance(values[0], int):
            batch[key] = torch.tensor(values)
        else:
            batch[key] = values
    return batch


def check_cache(info: dict, config, family: str) -> None:
    """A latent cache must come from the same model family, resolution and clip length."""
    want = {"family": family, "resolution": list(config.resolution)}
    if info.get("video"):
        want["num_frames"] = config.num_frames
    diff = [f"{k}: cache {info.get(k)!r}, config {v!r}" for k, v in want.items() if info.get(k) != v]
    if diff:
        raise ValueError(f"latent cache does not match this recipe ({'; '.join(diff)}); rerun recipes/precompute.py")
