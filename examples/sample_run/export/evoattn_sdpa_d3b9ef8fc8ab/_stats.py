"""Counts the package's calls: those that ran the kernel, and those that fell back, by reason.

A call is counted on the host as it runs. A call made while a CUDA graph is being captured
runs on every replay with no Python: it is counted instead by an int64 counter on its device,
raised by a kernel captured with the call (count_captured), and stats() adds those counters
(reading them waits for the device). A device's counter is made at the first decision for it
outside a capture (watch): a call captured before any, counted on the host, counts once, as
does an eager fallback captured by the caller's own torch.cuda.graph (attention() runs SDPA
for it without the op, the C++ path included).
"""
from __future__ import annotations

from typing import Any

import torch

from ._meta import NAMESPACE, log

# Device types whose captured calls are counted on the device (tests add "cpu").
GRAPH_DEVICE_TYPES = ("cuda",)
SLOTS = 256                              # outcomes per device counter: the kernel, then reasons

counts = {"kernel": 0}
_reasons: dict[str, list[int]] = {}      # a fallback's reason: [its calls] (a cell an entry holds)
_logged: set[str] = set()
_slots: dict[str | None, int] = {None: 0}          # outcome (None: the kernel) -> counter index
_on_device: dict[torch.device, torch.Tensor] = {}  # device -> its (SLOTS,) int64 counter


def _not_capturing() -> bool:
    return False


capturing = torch.cuda.is_current_stream_capturing if torch.cuda.is_available() \
    else _not_capturing


def stats() -> dict[str, Any]:
    """Returns how many calls ran the kernel and how many fell back, with the reasons.

    Under torch.compile the op's own calls are counted as they run; a call that Python code
    around the op sends elsewhere (the Hugging Face integration's refusals, inputs that need
    grad) is decided once when the graph is traced and is not counted per call: counting it
    would make the count a constant of the graph, and every call a recompile."""
    kernel = counts["kernel"]
    reasons = {r: cell[0] for r, cell in _reasons.items()}
    for counter in _on_device.values():
        on_device = counter.tolist()
        for outcome, slot in _slots.items():
            if outcome is None:
                kernel += on_device[slot]
            else:
                reasons[outcome] = reasons.get(outcome, 0) + on_device[slot]
    reasons = {r: n for r, n in reasons.items() if n}
    return {"kernel": kernel, "fallback": sum(reasons.values()), "fallback_reasons": reasons}


def reset_stats() -> None:
    """Sets the call counts back to zero."""
    counts["kernel"] = 0
    for cell in _reasons.values():            # entries hold their cells: zero them in place
        cell[0] = 0
    for counter in _on_device.values():
        counter.zero_()


def reason_cell(reason: str) -> list[int]:
    """Returns the one-element list that counts the calls falling back for `reason`."""
    return _reasons.setdefault(reason, [0])


def note_fallback(reason: str) -> None:
    """Counts one call that ran PyTorch instead; logs the reason the first time it is seen."""
    if torch.compiler.is_compiling():
        return
    reason_cell(reason)[0] += 1
    log_once(reason)


def log_once(reason: str, warning: bool = False) -> None:
    """Logs why calls fall back, once per reason (a warning where the kernel failed to load)."""
    if reason not in _logged:
        _logged.add(reason)
        if warning:
            log.warning("%s: %s; running PyTorch SDPA instead", NAMESPACE, reason)
        else:
            log.debug("%s: falling back to PyTorch SDPA: %s", NAMESPACE, reason)


def graphed(device: torch.device) -> bool:
    """Whether calls on `device` may be captured in a graph (and counted on the device)."""
    return device.type in GRAPH_DEVICE_TYPES


def watch(device: torch.device) -> None:
    """Makes `device`'s counter of captured calls, unless it has one or a capture is on."""
    if device not in _on_device and graphed(device) and not capturing():
        _on_device[device] = torch.zeros(SLOTS, dtype=torch.int64, device=device)


def count_captured(reason: str | None, device: torch.device) -> None:
    """Moves one call just counted on the host (reason None: a kernel call), made while a
    graph is captured, to `device`'s counter, so that each replay counts it."""
    counter = _on_device.get(device)
    slot = _slots.get(reason)
    if slot is None and len(_slots) < SLOTS:
        slot = _slots[reason] = len(_slots)
    if counter is None or slot is None:
        return                                # counted once, on the host
    counter[slot].add_(1)                     # captured: runs on every replay
    if reason is None:
        counts["kernel"] -= 1
    else:
        reason_cell(reason)[0] -= 1
