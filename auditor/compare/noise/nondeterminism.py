"""The reference's own nondeterminism, named (docs/noise.md, "Where the noise starts").

Differences among reruns of the reference are not the candidate's fault; they are the
reference's own nondeterminism, and a report says so: where it starts in execution order (the
first key its reruns disagree on, and the capture before it, which they agree on), how far it
reaches (keys per phase, steps, the largest relative distance), the likely mechanism where the
sites show it, and how to turn it off for those who want bitwise reruns.

Mechanisms, read off the first key that differs and the capture before it:

- ``bwd`` at or right after an attention module: its backward (SDPA's flash, memory-efficient
  and cuDNN kernels accumulate dQ/dK/dV with atomics);
- ``bwd`` or ``grad`` at an embedding: its backward (``embedding_dense_backward`` /
  ``index_add_`` accumulate rows with atomics);
- ``grad`` of a norm's weight (activation gradients agree): the weight-gradient reduction over
  every token, the longest and most cancelling in a model, done in split or atomic partial sums;
- ``grad`` of another weight: a split-K weight-gradient matmul (or another reduction order);
- ``fwd``: the forward itself (split-K matmuls, atomic adds such as a MoE's token combine);
- ``input``: the data (a shuffle, an augmentation, a dropout mask drawn differently).
"""

from __future__ import annotations

import re

import numpy as np

from numaudit.auditor.compare.read.align import Key, phase_name, role_name

_ATTENTION = re.compile(r"attn|attention|sdpa|mha|flash", re.I)
_EMBEDDING = re.compile(r"embed|(^|\.)wte$|(^|\.)tok($|\.)|tok_embeddings|lookup", re.I)
_NORM = re.compile(r"norm|(^|\.)ln(_\w+)?($|\.)", re.I)

DETERMINISTIC = ("`torch.use_deterministic_algorithms(True)` (on CUDA with "
                 "CUBLAS_WORKSPACE_CONFIG=:4096:8)")
ADVICE = {
    "attention backward": (
        "run attention on a deterministic backend: `with torch.nn.attention.sdpa_kernel("
        "SDPBackend.MATH)`, or attn_implementation=\"eager\" in transformers (cuDNN's SDPA "
        "backward stays nondeterministic under use_deterministic_algorithms with warn_only)"),
    "embedding backward": f"{DETERMINISTIC} makes the embedding's backward sort its rows "
                          "instead of accumulating them with atomics",
    "norm-weight reductions": f"{DETERMINISTIC} (norm kernels then reduce the weight gradient "
                              "in a fixed order, or fall back to one that does)",
    "split-K matmuls": DETERMINISTIC,
    "forward kernels": DETERMINISTIC,
    "backward kernels": DETERMINISTIC,
    "data loading": "seed the sampler, shuffling and augmentation (and dropout) alike in every run",
}


def key_of(a: int, site: str, b: int) -> Key:
    return Key(step=a >> 24, microbatch=((a >> 4) & 0xFFFFF) - 1, phase=phase_name(a & 0xF),
               site=site, role=role_name((b >> 28) & 0xF), index=(b >> 14) & 0x3FFF,
               call=b & 0x3FFF)


def describe_noise(bands, comp=None) -> dict:
    """The nondeterminism among the runs the bands were measured on: ``{"differs", "first",
    "previous", "reach", "worst", "mechanism", "advice", "text"}`` (keys as dicts). The order
    is the execution order of the bands' first pair (``bands.meta["order"]``)."""
    from numaudit.auditor.compare.noise.bands import NOISY

    order = bands.meta.get("order")
    if order is None or not len(bands):
        order = np.arange(len(bands))
    noisy = np.flatnonzero(bands.state == NOISY)
    runs = ", ".join(bands.runs)
    if not len(noisy):
        return {"differs": False, "first": None, "previous": None, "reach": {}, "worst": None,
                "mechanism": None, "advice": "",
                "text": f"the reference's runs ({runs}) are bitwise equal at every key they "
                        "share: no nondeterminism to band"}
    by_order = np.argsort(order, kind="stable")
    pos = np.empty(len(order), np.int64)
    pos[by_order] = np.arange(len(order))
    first = int(noisy[np.argmin(pos[noisy])])
    prev_pos = int(pos[first]) - 1
    previous = int(by_order[prev_pos]) if prev_pos >= 0 else None
    kf = _key(bands, first)
    kp = _key(bands, previous) if previous is not None else None
    if kp is not None and (kp.step, kp.microbatch) != (kf.step, kf.microbatch):
        kp = None  # the capture before it belongs to another block: no module between them
    phases: dict[str, list[int]] = {}
    for g in range(len(bands)):
        ph = phase_name(int(bands.when[g]) & 0xF)
        c = phases.setdefault(ph, [0, 0])
        c[1] += 1
        c[0] += int(bands.state[g] == NOISY)
    steps = sorted({int(bands.when[g]) >> 24 for g in noisy})
    rel = np.where(np.isnan(bands.rel[noisy]), -1.0, bands.rel[noisy])
    worst = int(noisy[int(np.argmax(rel))])
    mechanism = _mechanism(kf, kp)
    advice = ADVICE[mechanism["name"]]
    last = int(noisy[np.argmax(pos[noisy])])
    reach = {"keys": int(len(noisy)), "of": int(len(bands)),
             "by_phase": {p: {"differ": c[0], "of": c[1]} for p, c in phases.items()},
             "steps": steps, "last": _key(bands, last).as_dict()}
    shown = ", ".join(f"{p} {c[0]} of {c[1]}" for p, c in phases.items() if c[0])
    before = f" (the capture before it, {kp}, is bitwise equal in every run)" if kp else ""
    text = (f"the reference's own nondeterminism: its runs ({runs}) first differ at {kf}"
            f"{before}; {len(noisy)} of {len(bands)} keys differ among them ({shown}), in "
            f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}, the most at "
            f"{_key(bands, worst)} (rel_l2 {float(bands.rel[worst]):.3g}). Likely mechanism: "
            f"{mechanism['name']} ({mechanism['evidence']}). For bitwise reruns: {advice}")
    return {"differs": True, "first": kf.as_dict(), "previous": kp.as_dict() if kp else None,
            "reach": reach,
            "worst": {"key": _key(bands, worst).as_dict(), "rel_l2": float(bands.rel[worst])},
            "mechanism": mechanism, "advice": advice, "text": text}


def _key(bands, g: int) -> Key:
    a, b = int(bands.when[g]), int(bands.where[g])
    return key_of(a, bands.sites[b >> 32], b & 0xFFFFFFFF)


def _mechanism(first: Key, previous: Key | None) -> dict:
    """The likely mechanism: {"name", "evidence"} (module docstring)."""
    sites = [first.site] + ([previous.site] if previous is not None else [])
    phase = first.phase
    between = (f"between {previous.site}'s {previous.role} and {first.site}'s {first.role}, "
               if previous is not None else f"at {first.site}, ")
    if phase == "input":
        return {"name": "data loading", "evidence": "the batch itself differs"}
    if phase in ("fwd", "loss"):
        return {"name": "forward kernels",
                "evidence": f"the forward already differs at {first.site}: split-K matmuls or "
                            "atomic adds (index_add_, scatter_add_: a MoE's token combine)"}
    if phase == "bwd":
        if any(_ATTENTION.search(s) for s in sites):
            return {"name": "attention backward",
                    "evidence": f"backward first differs {between}where an attention's backward "
                                "runs"}
        if any(_EMBEDDING.search(s) for s in sites):
            return {"name": "embedding backward",
                    "evidence": f"backward first differs {between}at an embedding"}
        return {"name": "backward kernels",
                "evidence": f"backward first differs {between}in that module's backward: "
                            "atomic accumulation or a split-K matmul"}
    if _EMBEDDING.search(first.site):
        return {"name": "embedding backward",
                "evidence": f"the first gradient that differs is the embedding's ({first.site}) "
                            "while the activation gradients agree"}
    if _NORM.search(first.site.rsplit(".", 1)[0]) or _NORM.search(first.site):
        return {"name": "norm-weight reductions",
                "evidence": f"the first gradient that differs is a norm's weight ({first.site}), "
                            "a reduction over every token, while the activation gradients agree"}
    return {"name": "split-K matmuls",
            "evidence": f"the first gradient that differs is {first.site}'s while the "
                        "activation gradients agree: a weight-gradient matmul reduced in "
                        "another order"}

