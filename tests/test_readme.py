"""The README's snippets run as written, offline: tiny local models stand in for hub ids and sizes
shrink to what a CPU samples in seconds. Every snippet is either run here or named with why not."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mhla_diffusion import zoo

ROOT = Path(__file__).resolve().parents[1]
SHRINK = "num_frames=5, height=32, width=32, num_inference_steps=2, max_sequence_length=16"
# Snippets that cannot run offline or on a CPU in a test, by their first line.
NOT_RUN = {
    'pip install -e ".[eval,train]"': "installs from the package registry",
    "make demo": "make demo is `mhla-diffusion demo` (tests/test_demo.py); make test is this suite",
    "accelerate launch recipes/train.py": "a template (DATA, option alternatives); the recipes' own tests launch it",
    'pip install -e ".[experiments]"': "installs from the package registry; the digits experiment's tests run its toy preset",
    "python recipes/experiments/digits.py --preset mosaic-full": "one GPU for minutes; tests/test_mosaic_experiment.py runs its toy preset",
    "python recipes/experiments/digits.py --preset mosaic-random-flow": "one H200 for ~10 minutes; tests/test_mosaic_experiment.py "
                                                                       "runs its path (random layouts, --objective flow) at toy size",
    "# torchrun --nproc_per_node 4 my_script.py": "needs several processes; tests/test_sequence_parallel.py runs it",
}


def snippets(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def run_python(code: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{code}\n{proc.stderr[-3000:]}"


def test_every_snippet_is_run_or_named():
    handled = ("import torch, diffusers, mhla_diffusion as md", "mhla-diffusion transfer wan-original")
    for code in snippets("python") + snippets("bash"):
        first = code.splitlines()[0]
        assert first.startswith(handled) or any(first.startswith(k) for k in NOT_RUN), f"README snippet not covered: {first}"


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    zoo.build_pipeline("wan").save_pretrained(root / "wan-original")
    return root


def quick_start() -> str:
    (code,) = [c for c in snippets("python") if c.startswith("import torch, diffusers, mhla_diffusion as md")]
    return code.replace('"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"', '"wan-original"').replace("num_frames=81", SHRINK)


def test_quick_start_runs_and_saves_a_dir_plain_diffusers_loads_as_mhla(tiny_wan):
    run_python(quick_start() + "\nassert type(pipe.transformer).__name__ == 'MHLAWanTransformer3DModel'", tiny_wan)
    index = json.loads((tiny_wan / "wan-mhla" / "model_index.json").read_text())
    assert index["transformer"] == ["mhla_diffusion", "MHLAWanTransformer3DModel"]


def test_the_diffusers_way_builds_the_variant_convert_builds(tiny_wan, tmp_path):
    """The commented alternative of the quick start, uncommented in place of `md.convert(pipe)`."""
    code = quick_start().replace('"wan-mhla"', '"wan-diffusers-way"')
    code = re.sub(r"^md\.convert\(pipe\).*\n", "", code, flags=re.M)
    code = re.sub(r"^#   ", "", code, flags=re.M)
    run_python(code, tiny_wan)
    way = json.loads((tiny_wan / "wan-diffusers-way" / "transformer" / "config.json").read_text())["mhla"]
    converted = json.loads((tiny_wan / "wan-mhla" / "transformer" / "config.json").read_text())["mhla"]
    assert way["layers"] == "hybrid:3" and {k: v for k, v in way.items() if k != "layers"} == {
        k: v for k, v in converted.items() if k != "layers"}  # the released Wan variant both ways


def test_transfer_snippet_runs_on_the_tiny_pipeline(tiny_wan):
    (code,) = [c for c in snippets("bash") if c.startswith("mhla-diffusion transfer wan-original")]
    line = code.splitlines()[0].replace(" wan-mhla ", " wan-mhla-transfer ").replace(
        "--num-samples 16 --height 480 --width 832 --num-frames 81", "--num-samples 2 --height 32 --width 32 --num-frames 5 --steps 2")
    (tiny_wan / "prompts.txt").write_text("a red cat\na blue house\n")
    cli = [sys.executable, str(ROOT / "cli.py"), *line.split()[1:], "--steps-per-layer", "5"]
    proc = subprocess.run(cli, cwd=tiny_wan, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tiny_wan / "wan-mhla-transfer" / "transfer.json").is_file()
