"""Launch settings changed for one run (`bench op --set`, `bench model --set`): a candidate setting is timed and
checked by the shipped commands, so a measurement in BENCHMARKS.md names a command anyone can run again.

A setting is `TABLE.KEY[.KEY...]=VALUE`: TABLE one of the kernels' settings tables (`TABLES`), each KEY one the table
already has at that depth (a misspelt key is refused, not added; the override tables of `mhla.CONFIG` take its keys
too; a table keyed by numbers takes them as digits: `mhla.CONFIG.grad.narrow_warps.32=4`), and VALUE a Python literal:
`parallel.CONFIG.split_heads=('forward',)`, `parallel.CONFIG.forward_long.num_stages=4`.
"""

from __future__ import annotations

import ast
import contextlib
from typing import Iterator

from . import compiled, mhla, parallel, rms_norm

TABLES = {"mhla.CONFIG": mhla.CONFIG, "mhla.ROPE_CONFIG": mhla.ROPE_CONFIG, "mhla.SHORT_CONFIG": mhla.SHORT_CONFIG,
          "mhla.SHORTEST_CONFIG": mhla.SHORTEST_CONFIG, "parallel.CONFIG": parallel.CONFIG,
          "rms_norm.CONFIG": rms_norm.CONFIG, "compiled.CONFIG": compiled.CONFIG}
# Tables that override another one's entries for the token kernels (`mhla._config`): a key of those is theirs too.
TOKEN_KERNELS = {kernel: mhla.CONFIG[kernel] for kernel in ("summary", "output", "grad")}
OVERRIDDEN = dict.fromkeys(("mhla.ROPE_CONFIG", "mhla.SHORT_CONFIG", "mhla.SHORTEST_CONFIG"), TOKEN_KERNELS)
# Settings whose value is a tuple of names, and the names each takes.
NAMES = {("parallel.CONFIG", ("split_heads",)): parallel.SPLIT_KERNELS,
         ("compiled.CONFIG", ("trigger_dependents",)): compiled.LAUNCHES}


def _keys_holding_none() -> set:
    """Keys some table holds None for (a cap left to the compiler): None is a value there, and nowhere else."""
    found, stack = set(), [*TABLES.values()]
    while stack:
        table = stack.pop()
        found.update(key for key, value in table.items() if value is None)
        stack.extend(value for value in table.values() if isinstance(value, dict))
    return found


def parse(setting: str) -> tuple[str, tuple[str, ...], object]:
    """(table name, keys, value) of one `TABLE.KEY[.KEY...]=VALUE`, checked against the tables as they are."""
    path, sep, literal = setting.partition("=")
    table = next((name for name in TABLES if path.startswith(name + ".")), None)
    if not sep or table is None:
        raise ValueError(f"--set {setting!r}: expected TABLE.KEY=VALUE with TABLE one of {', '.join(TABLES)}")
    keys = tuple(path[len(table) + 1:].split("."))
    try:
        value = ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        raise ValueError(f"--set {setting!r}: {literal!r} is not a Python literal (quote strings: 'forward')") from None
    mine, reference = TABLES[table], OVERRIDDEN.get(table, {})
    resolved = []  # the keys as the tables hold them: a table keyed by head width holds numbers
    for depth, key in enumerate(keys):
        known = set(mine) | set(reference)
        key = int(key) if key.isdigit() and int(key) in known else key
        resolved.append(key)
        if key not in known:
            where = ".".join((table, *keys[:depth]))
            have = ", ".join(str(k) for k in sorted(known, key=str))
            raise ValueError(f"--set {setting!r}: {where} has no key {key!r} (it has {have})")
        if depth < len(keys) - 1:
            mine, reference = mine.get(key, {}), reference.get(key, {})
            if not isinstance(mine, dict) or not isinstance(reference, dict):
                raise ValueError(f"--set {setting!r}: {'.'.join((table, *keys[:depth + 1]))} holds a value, not keys")
    was = mine.get(resolved[-1], reference.get(resolved[-1]))
    if isinstance(was, dict) or isinstance(value, dict):
        raise ValueError(f"--set {setting!r}: {path} holds keys; set one of them ({path}.KEY=VALUE)")
    if value is None and keys[-1] not in _keys_holding_none():
        raise ValueError(f"--set {setting!r}: {path} takes no None (it holds {was!r})")
    if None not in (was, value) and type(was) is not type(value):
        raise ValueError(f"--set {setting!r}: {path} holds {was!r} ({type(was).__name__}), not {value!r} "
                         f"({type(value).__name__})")
    names = NAMES.get((table, keys))
    if names is not None and not set(value) <= set(names):
        raise ValueError(f"--set {setting!r}: {path} names kernels of {names}, not {sorted(set(value) - set(names))}")
    return table, tuple(resolved), value


@contextlib.contextmanager
def overridden(settings: list[str]) -> Iterator[None]:
    """The `settings` in force, every table as it was afterwards. All are checked before any is applied; a nested
    entry is changed in a copy put in its place, so the table's own entries (which other code may hold) never change
    and are put back as they were."""
    parsed = [parse(s) for s in settings]
    saved = {name: dict(TABLES[name]) for name in {table for table, _, _ in parsed}}
    try:
        for table, keys, value in parsed:
            entry = TABLES[table]
            for key in keys[:-1]:
                entry[key] = dict(entry.get(key, {}))
                entry = entry[key]
            entry[keys[-1]] = value
        yield
    finally:
        for name, was in saved.items():
            TABLES[name].clear()
            TABLES[name].update(was)


def describe(settings: list[str]) -> str:
    """What a report's device line adds for a run with `settings` changed ("" for none)."""
    return f" (settings changed: {'; '.join(settings)})" if settings else ""
