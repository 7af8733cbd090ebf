"""The device groups of a collective: read from its HLO attributes, placed on a hybrid mesh.

``replica_groups`` comes in several printed forms (explicit lists, iota, XLA's newer
mesh axes); ``source_target_pairs`` lists a permute's pairs. :func:`groups_of` reads
either from an instruction, :func:`scope` says whether a collective's groups stay
inside the groups of a hybrid mesh, link them, or span both.
"""

from __future__ import annotations

import math
import re

import numpy as np

from jaxzero.accounting.hlo import Instruction

_IOTA = r"\[[\d,]+\](?:<=\[[\d,]+\])?(?:T\([\d,]+\))?"
_MESH = r"mesh\[[^\]]*\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{[^{}]*\}"
_GROUPS_RE = re.compile(rf"replica_groups=(\{{(?:[^{{}}]|\{{[^{{}}]*\}})*\}}|{_MESH}|{_IOTA})")
_PAIRS_RE = re.compile(r"source_target_pairs=(\{(?:[^{}]|\{[^{}]*\})*\})")


def _iota(text: str) -> np.ndarray | None:
    """``[2,4]<=[4,2]T(1,0)``: ``iota`` reshaped to the bracket after ``<=`` (else the
    first), transposed by ``T(...)`` if given, then reshaped to the first bracket."""
    m = re.fullmatch(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", text.strip())
    if not m:
        return None
    dims = [int(x) for x in m.group(1).split(",")]
    base = [int(x) for x in (m.group(2) or m.group(1)).split(",")]
    ids = np.arange(math.prod(base)).reshape(base)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(dims)


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """``mesh['r'=2,'d'=4] {'r'}``: the devices that differ only along the listed axes.

    The mesh holds logical device ids in row-major order (or ``device_ids=(...)``, iota
    or listed). A listed axis may be a sub-axis ``'d':(pre)size``: the digit
    ``(index // pre) % size`` of that axis. Within a group, devices are ordered by the
    listed axes' digits in the order listed.
    """
    m = re.fullmatch(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((.*)\))?\s*\{([^{}]*)\}", text.strip())
    if not m:
        raise ValueError(f"cannot parse replica groups {text!r}")
    names, sizes = [], []
    for axis in m.group(1).split(","):
        name, size = axis.rsplit("=", 1)
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    if m.group(2) is None:
        ids = np.arange(math.prod(sizes))
    else:
        iota = _iota(m.group(2))
        ids = (
            iota if iota is not None else np.array([int(x) for x in re.findall(r"\d+", m.group(2))])
        )
    ids = ids.reshape(sizes)
    digits = []  # (mesh axis, pre, size) of each listed (sub-)axis, in order
    for ref in filter(None, (r.strip() for r in m.group(3).split(","))):
        rm = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", ref)
        if not rm or rm.group(1) not in names:
            raise ValueError(f"cannot parse replica groups {text!r}: axis {ref!r}")
        i = names.index(rm.group(1))
        digits.append((i, int(rm.group(2)), int(rm.group(3))) if rm.group(2) else (i, 1, sizes[i]))
    groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
    for pos in np.ndindex(*sizes):
        own = [((pos[i] // pre) % size) for i, pre, size in digits]
        rest = list(pos)
        for (i, pre, _), d in zip(digits, own, strict=True):
            rest[i] -= d * pre
        groups.setdefault(tuple(rest), []).append((tuple(own), int(ids[pos])))
    return tuple(tuple(d for _, d in sorted(g)) for g in groups.values())


def parse_replica_groups(text: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups from ``{{0,1},{2,3}}``, ``{}`` (all devices), iota
    ``[2,4]<=[4,2]T(1,0)`` (see :func:`_iota`, reshaped to ``[num_groups, group_size]``)
    or mesh axes ``mesh['r'=2,'d'=4] {'r'}`` (:func:`_mesh_groups`; XLA's newer form).
    """
    text = text.strip()
    if text.startswith("{"):
        groups = tuple(
            tuple(int(x) for x in re.findall(r"\d+", g)) for g in re.findall(r"\{([^{}]*)\}", text)
        )
        groups = tuple(g for g in groups if g)
        return groups or (tuple(range(num_devices)),)
    if text.startswith("mesh["):
        return _mesh_groups(text)
    ids = _iota(text)
    if ids is None:
        raise ValueError(f"cannot parse replica groups {text!r}")
    ids = ids.reshape(ids.shape[0], -1) if ids.ndim > 1 else ids.reshape(1, -1)
    return tuple(tuple(int(x) for x in row) for row in ids)


def groups_of(
    ins: Instruction, kind: str, num_devices: int
) -> tuple[tuple[tuple[int, ...], ...], int]:
    """A collective instruction's device groups and N, the devices per group.

    A permute's groups are its source/target pairs, N the devices they touch; a
    collective without ``replica_groups`` runs over every device.
    """
    if kind == "collective-permute":
        pm = _PAIRS_RE.search(ins.attrs)
        pairs = parse_replica_groups(pm.group(1), num_devices) if pm else ()
        return pairs, len({d for p in pairs for d in p}) or num_devices
    gm = _GROUPS_RE.search(ins.attrs)
    if gm is None and "replica_groups=" in ins.attrs:  # a form we do not know
        at = ins.attrs.index("replica_groups=")
        raise ValueError(f"{ins.name}: cannot parse replica groups in {ins.attrs[at : at + 120]!r}")
    groups = parse_replica_groups(gm.group(1), num_devices) if gm else (tuple(range(num_devices)),)
    return groups, len(groups[0])


SCOPES = ("intra", "inter", "both")


def scope(groups: tuple[tuple[int, ...], ...], group_size: int) -> str:
    """Where a collective's traffic flows on a hybrid mesh of groups of ``group_size`` devices.

    Device ``d`` (its index in the mesh, which the SPMD program's ids follow) sits in
    group ``d // group_size`` at position ``d % group_size``. ``"intra"``: every
    replica group stays inside one group (the fast links of a node); ``"inter"``:
    it links the same position across groups (one all-reduce of the gradient shard);
    ``"both"``: it spans both (stage 0's all-reduce, replicated small leaves).
    """
    if all(len({d // group_size for d in g}) <= 1 for g in groups):
        return "intra"
    if all(len({d % group_size for d in g}) <= 1 for g in groups):
        return "inter"
    return "both"
