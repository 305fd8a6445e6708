"""The family registry: one module per family, and nothing outside those modules branches on a family."""

import re
from pathlib import Path

import pytest

import mhla_diffusion as md
from mhla_diffusion import families, zoo

ROOT = Path(__file__).resolve().parents[1]


def test_every_family_module_registers_one_family_with_its_own_classes():
    modules = sorted(p.stem for p in (ROOT / "mhla_diffusion" / "families").glob("*.py") if p.stem not in ("__init__", "base"))
    assert [f.name for f in families.FAMILIES] == modules
    classes = [c for f in families.FAMILIES for c in f.class_names]
    assert len(classes) == len(set(classes))
    names = families.real_model_names()
    assert len(names) == len(set(names))
    tiny = families.tiny_names()  # families and their named variants (zoo.build_transformer / build_pipeline)
    assert len(tiny) == len(set(tiny)) and list(zoo.FAMILIES) + list(zoo.VARIANTS) == tiny


@pytest.mark.parametrize("name", zoo.FAMILIES)
def test_family_of_a_converted_model_is_its_family(name):
    model = zoo.build_transformer(name)
    md.convert(model)
    fam = families.family_of(model)
    assert fam.name == name and families.family_by_name(type(model).__name__.removeprefix("MHLA")) is fam
    paths = fam.self_attention_paths(dict(model.config))
    assert [model.get_submodule(p) for p in paths] == fam.self_attentions(model)


def test_unknown_names_are_refused_with_the_supported_ones():
    with pytest.raises(ValueError, match="supported: dit"):
        families.family_by_name("flux")
    with pytest.raises(ValueError, match="real-size models: dit-xl-2"):
        families.real_model("flux-dev")


def test_no_module_outside_the_family_modules_branches_on_a_family_or_its_classes():
    names = "|".join(re.escape(n) for f in families.FAMILIES for n in (f.name, *f.class_names))
    branch = re.compile(rf"""(==|!=|\bin)\s*[(\[{{]?\s*["']({names})["']""")
    sources = [p for p in (ROOT / "mhla_diffusion").rglob("*.py") if "families" not in p.parts]
    sources += list((ROOT / "recipes").rglob("*.py"))
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sources
             for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert not found, f"branches on a family name outside mhla_diffusion/families: {found}"
