"""Small text helpers shared by the reports (audit, plan, fit)."""

from __future__ import annotations

from collections.abc import Sequence

from .device import DeviceSpec, GiB, MiB


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    """A duration in us below a millisecond, in ms below a second, else in s."""
    if s < 1e-3:
        return f"{1e6 * s:.3g} us"
    return f"{1e3 * s:.3g} ms" if s < 1 else f"{s:.3g} s"


def grid(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def first_line(err: BaseException) -> str:
    """The first line of an error's message ('' when it has none): what a one-line
    report quotes of someone else's error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def describe_device(spec: DeviceSpec) -> str:
    """One line for a device: what `detect` and `plan` print. A device without an HBM
    figure (a CPU) says so rather than printing 0 GiB."""
    where = spec.instance_type or spec.family
    lnc = f", LNC={spec.lnc}" if spec.lnc else ""
    if spec.is_neuron:
        what = (f"{plural(spec.cores, 'core')} visible, {spec.cores_per_chip} per chip, "
                f"{fmt_bytes(spec.hbm_bytes_per_core)} HBM per core")
    elif spec.hbm_bytes_per_core:
        what = (f"{plural(spec.cores, 'device')} visible, "
                f"{fmt_bytes(spec.hbm_bytes_per_core)} memory per device")
    else:
        what = f"{plural(spec.cores, 'device')} visible, no HBM figure (not a Neuron device)"
    unverified = " (unverified figures)" if not spec.verified else ""
    return f"{where}{lnc}: {what}{unverified} [source: {spec.source}]"


def tag_list(tags: Sequence[str], width: int | None = None) -> str:
    """Tags for a table cell: without their class prefix (``MultiheadAttention.q_proj`` ->
    ``q_proj``) where that leaves them distinct; with `width`, cut to whole names that fit
    and a count of the rest."""
    short = [t.rsplit(".", 1)[-1] for t in tags]
    names = short if len(set(short)) == len(short) else list(tags)
    if not names:
        return "nothing"
    text = ", ".join(names)
    if width is None or len(text) <= width:
        return text
    keep = 1  # at least one name, whatever its length
    while keep < len(names) and len(", ".join(names[:keep + 1])
                                    + f" +{len(names) - keep - 1} more") <= width:
        keep += 1
    return ", ".join(names[:keep]) + (f" +{len(names) - keep} more" if keep < len(names) else "")
