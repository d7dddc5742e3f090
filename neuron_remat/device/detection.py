"""Detection: the evidence this machine gives (JAX, Neuron sysfs, ``neuron-ls``, EC2 DMI),
weighed in the order the package docstring gives, and cached per process. Nothing here runs
at import time."""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass

from .facts import _DEVICE_KINDS, _FAMILY_WORDS, CHIPS, INSTANCES, GiB, InstanceFacts
from .parsing import (OVERRIDE_ENV, _lnc_from_env, _resolve_lnc, _show, _visible_cores,
                      parse_device)
from .spec import DeviceSpec, Evidence, _cpu_spec, _spec

logger = logging.getLogger("neuron_remat.device")  # one logger for the package


# --------------------------------------------------------------------------------------
# Evidence from the machine. Each probe returns a partial answer or None, and never
# raises for what the machine reported.
# --------------------------------------------------------------------------------------


@dataclass
class _Probe:
    family: str | None = None
    instance: InstanceFacts | None = None
    chips: int | None = None
    cores: int | None = None  # logical cores as the probe counted them
    lnc: int | None = None
    chip_memory: int | None = None  # bytes of HBM per chip (neuron-ls's memory_size)
    device_kind: str | None = None
    provisional: bool = False  # the family could be another with the same signature


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(4096).strip()  # sysfs and DMI files are a line; never a stream
    except FileNotFoundError:
        return None
    except OSError as err:  # PermissionError for root-only (0400) files, EIO, ...
        logger.info("neuron_remat: cannot read %s (%s); ignoring it", path, err)
        return None


def _family_word(text: str | None) -> str | None:
    if not text:
        return None
    word = text.strip().lower()
    if word in INSTANCES:
        return INSTANCES[word].family
    return _FAMILY_WORDS.get(word) or _FAMILY_WORDS.get(word.split(".")[0])


def _probe_jax(notes: list[Evidence]) -> tuple[_Probe | None, str | None, int]:
    """(neuron probe, other family, local device count) from JAX; (None, None, 0) when
    JAX cannot say."""
    try:
        import jax  # noqa: PLC0415  (imported on first detection, never at import time)

        backend = jax.default_backend()
        devices = jax.local_devices()
    except Exception as err:  # noqa: BLE001  a broken plugin must not break detection
        notes.append(Evidence("jax", f"unavailable ({type(err).__name__}: {err})"))
        return None, None, 0
    kind = getattr(devices[0], "device_kind", None) if devices else None
    if backend == "neuron":
        family, lnc = _DEVICE_KINDS.get(kind or "", (None, None))
        desc = f"backend neuron, device_kind {kind!r}, {len(devices)} local devices"
        if family is None:
            desc += " (device_kind not recognised: family taken from later evidence)"
        notes.append(Evidence("jax", desc))
        # NC_v2 is both Trn1 and Inf2: later evidence may say which.
        probe = _Probe(family=family, cores=len(devices), lnc=lnc, device_kind=kind,
                       provisional=kind == "NC_v2")
        return probe, None, len(devices)
    other = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(
        backend, "unknown")
    notes.append(Evidence("jax", f"backend {backend!r} ({len(devices)} local devices, "
                                 f"device_kind {kind!r})"))
    return None, other, len(devices)


def _probe_sysfs(root: str, notes: list[Evidence]) -> _Probe | None:
    base = os.path.join(root, "sys/devices/virtual/neuron_device")
    devs = sorted(glob.glob(os.path.join(base, "neuron[0-9]*")))
    if not devs:
        notes.append(Evidence("sysfs", f"no Neuron devices under {base}"))
        return None
    arch = os.path.join(devs[0], "info", "architecture")
    words = {n: _read(os.path.join(arch, n)) for n in ("arch_type", "device_name", "instance_type")}
    family = None
    for name in ("arch_type", "device_name", "instance_type"):
        family = family or _family_word(words[name])
    inst_text = (words["instance_type"] or "").lower()
    instance = INSTANCES.get(inst_text)
    physical = _read(os.path.join(devs[0], "core_count"))
    shown = ", ".join(f"{k}={v!r}" for k, v in words.items() if v is not None) or "unreadable"
    notes.append(Evidence(
        "sysfs", f"{len(devs)} devices; {shown}"
        + (f"; core_count={physical}" if physical and physical.isdigit() else "")
        + ("" if family else "; family not recognised")))
    return _Probe(family=family, instance=instance, chips=len(devs))


def _find_neuron_ls(root: str, environ: Mapping[str, str]) -> str | None:
    path = environ.get("PATH", os.defpath)
    extra = os.path.join(root, "opt/aws/neuron/bin")
    return shutil.which("neuron-ls", path=os.pathsep.join([path, extra]))


def _probe_neuron_ls(root: str, environ: Mapping[str, str], timeout: float,
                     notes: list[Evidence]) -> _Probe | None:
    if not glob.glob(os.path.join(root, "dev/neuron[0-9]*")):
        notes.append(Evidence("neuron-ls", "not run: no /dev/neuron* device nodes"))
        return None
    exe = _find_neuron_ls(root, environ)
    if exe is None:
        notes.append(Evidence("neuron-ls", "not found on PATH or in /opt/aws/neuron/bin"))
        logger.info("neuron_remat: /dev/neuron* exists but neuron-ls is not installed")
        return None
    try:
        run = subprocess.run([exe, "-j"], capture_output=True, text=True, errors="replace",
                             timeout=timeout, env=dict(environ), check=False)
    except subprocess.TimeoutExpired:
        notes.append(Evidence("neuron-ls", f"timed out after {timeout:g} s"))
        logger.warning("neuron_remat: %s -j hung for %.3g s; ignoring it", exe, timeout)
        return None
    except OSError as err:
        notes.append(Evidence("neuron-ls", f"could not run ({err})"))
        return None
    try:
        chips = json.loads(run.stdout)
        if not isinstance(chips, list) or not chips or not all(isinstance(c, dict) for c in chips):
            raise ValueError("expected a non-empty JSON list of device objects")
        nc = [_count(c, "nc_count") for c in chips]
        mem = _count(chips[0], "memory_size")
        lnc = _count(chips[0], "logical_neuroncore_config", None)
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        snippet = (run.stdout or run.stderr or "").strip()[:80]
        notes.append(Evidence("neuron-ls", f"unusable output ({err}): {snippet!r}"))
        logger.warning("neuron_remat: neuron-ls -j printed unusable output (%s)", err)
        return None
    family = {96 * GiB: "trn2", 144 * GiB: "trn3", 32 * GiB: "trn1"}.get(mem)
    notes.append(Evidence(
        "neuron-ls", f"{len(chips)} devices, nc_count {nc[0]}, memory_size {mem}, LNC {lnc}"))
    return _Probe(family=family, chips=len(chips), cores=sum(nc), lnc=lnc,
                  provisional=family == "trn1",  # 32 GiB per device: Trn1 or Inf2
                  chip_memory=mem or None)


def _count(row: dict, key: str, default: Any = KeyError) -> Any:
    """An integer field of a neuron-ls row: a JSON integer (or its digits as a string), not
    a boolean or a float; a missing one is `default` (KeyError: required)."""
    if key not in row or (row[key] is None and default is not KeyError):
        if default is KeyError:
            raise KeyError(key)
        return default
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{key} {value!r} is not an integer")
    return int(value)


def _probe_dmi(root: str, notes: list[Evidence]) -> _Probe | None:
    dmi = os.path.join(root, "sys/devices/virtual/dmi/id")
    vendor = _read(os.path.join(dmi, "sys_vendor"))
    product = _read(os.path.join(dmi, "product_name"))
    if product is None:
        notes.append(Evidence("dmi", "no product_name"))
        return None
    name = product.strip().lower()
    if vendor is not None and not vendor.lower().startswith("amazon"):
        notes.append(Evidence("dmi", f"sys_vendor {vendor!r} is not Amazon EC2"))
        return None
    if name in INSTANCES:
        notes.append(Evidence("dmi", f"product_name {product!r}, sys_vendor {vendor!r}"))
        return _Probe(family=INSTANCES[name].family, instance=INSTANCES[name])
    notes.append(Evidence("dmi", f"product_name {product!r} is not a Neuron instance"))
    return None


# --------------------------------------------------------------------------------------
# detect()
# --------------------------------------------------------------------------------------

_CACHE: dict[tuple[Any, ...], DeviceSpec] = {}
_LOCK = threading.Lock()
_ENV_KEYS = (OVERRIDE_ENV, "NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VISIBLE_CORES",
             "NEURON_RT_NUM_CORES")


def detect(
    *,
    refresh: bool = False,
    root: str = "/",
    environ: Mapping[str, str] | None = None,
    use_jax: bool = True,
    neuron_ls_timeout: float = 5.0,
) -> DeviceSpec:
    """Detect the device this process trains on (see the module docstring for the order).

    The answer is cached per process, per `root` and per value of the ``NEURON_*``
    variables that matter; ``refresh=True`` looks again. Thread-safe.

    Args:
        refresh: ignore the cache and look again.
        root: filesystem root for sysfs, DMI and ``/dev`` (tests lay out fake trees).
        environ: environment to read (default ``os.environ``).
        use_jax: ask JAX (step 2). Off, detection never starts a JAX backend.
        neuron_ls_timeout: seconds ``neuron-ls -j`` may take.
    """
    if isinstance(neuron_ls_timeout, bool) or not isinstance(neuron_ls_timeout, (int, float)) \
            or not 0 < neuron_ls_timeout <= 600:  # NaN fails too
        raise ValueError(f"neuron_ls_timeout={neuron_ls_timeout!r}: give seconds above 0 and "
                         "at most 600")
    env = os.environ if environ is None else environ
    key = (os.path.abspath(root), use_jax, neuron_ls_timeout, env.get("PATH"),
           tuple(env.get(k) for k in _ENV_KEYS))
    with _LOCK:
        if not refresh and key in _CACHE:
            return _CACHE[key]
        spec = _detect(root, env, use_jax, neuron_ls_timeout)
        _CACHE[key] = spec
    logger.info("neuron_remat: detected %s", spec.describe())
    return spec


def looks_like_neuron(*, root: str = "/", environ: Mapping[str, str] | None = None) -> bool:
    """A cheap guess, for checks that must not probe: True when ``NEURON_REMAT_DEVICE``
    names a Neuron device, an earlier `detect` found one, or Neuron device nodes or sysfs
    entries exist. Never raises, never asks JAX or runs ``neuron-ls``."""
    env = os.environ if environ is None else environ
    override = env.get(OVERRIDE_ENV, "").strip()
    if override:
        try:
            return parse_device(override, environ=env).is_neuron
        except ValueError:
            return False
    if any(spec.is_neuron for spec in list(_CACHE.values())):
        return True
    return bool(glob.glob(os.path.join(root, "dev/neuron[0-9]*")) or glob.glob(
        os.path.join(root, "sys/devices/virtual/neuron_device/neuron[0-9]*")))


def _detect(root: str, env: Mapping[str, str], use_jax: bool, timeout: float) -> DeviceSpec:
    override = env.get(OVERRIDE_ENV, "").strip()
    if override:
        return parse_device(override, source="override", environ=env)
    notes: list[Evidence] = [Evidence("override", f"{OVERRIDE_ENV} not set")]

    jax_probe, other, n_local = None, None, 0
    if use_jax:
        jax_probe, other, n_local = _probe_jax(notes)
    else:
        notes.append(Evidence("jax", "skipped (use_jax=False)"))
    if other in ("gpu", "tpu", "unknown"):
        return _cpu_spec(other, "jax", _mark_decided(notes, "jax"), cores=max(n_local, 1))

    probes: list[tuple[str, _Probe]] = []
    if jax_probe is not None:
        probes.append(("jax", jax_probe))
    sysfs = _probe_sysfs(root, notes)
    if sysfs is not None:
        probes.append(("sysfs", sysfs))
    if sysfs is None or sysfs.family is None:
        ls = _probe_neuron_ls(root, env, timeout, notes)
        if ls is not None:
            probes.append(("neuron-ls", ls))
    else:
        notes.append(Evidence("neuron-ls", "not needed: sysfs answered"))
    dmi = _probe_dmi(root, notes)
    if dmi is not None:
        probes.append(("dmi", dmi))

    found = [(name, p) for name, p in probes if p.family]
    decided = found[0] if found else None
    if decided is not None and decided[1].provisional:  # Trn1 or Inf2: ask the rest
        decided = next(((name, p) for name, p in found[1:]
                        if not p.provisional and p.family in ("trn1", "inf2")), decided)
    if decided is None:
        if jax_probe is not None:  # neuron backend with an unknown device kind
            notes.append(Evidence("default", "Neuron backend of unknown generation"))
            return _cpu_spec("unknown", "jax", _mark_decided(notes, "jax"),
                             cores=jax_probe.cores or 1, device_kind=jax_probe.device_kind)
        source = "jax" if other == "cpu" else "default"
        notes.append(Evidence("default", "no Neuron hardware found: cpu"))
        return _cpu_spec("cpu", source, _mark_decided(notes, source))

    source, first = decided
    family = first.family
    assert family is not None
    # Later evidence fills what earlier evidence left open; it never overrides a family
    # (but for telling Inf2 from Trn1, above).
    instance = next((p.instance for _, p in probes if p.instance and p.instance.family == family), None)
    lnc = None
    for step, p in probes:  # the machine's report: a value the chip cannot have is noted
        if p.lnc is None:
            continue
        if p.lnc in CHIPS[family].lnc_options:
            lnc = p.lnc
            break
        notes.append(Evidence(step, f"LNC {p.lnc} ignored: {family} has "
                                    f"{_lnc_choices(family)}"))
    env_lnc = _lnc_from_env(env, family)
    if lnc is None:
        lnc = env_lnc
    elif env_lnc is not None and env_lnc != lnc:
        notes.append(Evidence("env", f"NEURON_LOGICAL_NC_CONFIG={env_lnc} disagrees with the "
                                     f"hardware's LNC={lnc}; using the hardware's"))
    lnc = _resolve_lnc(family, lnc, what="detected device")
    chips = next((p.chips for _, p in probes if p.chips), None)
    per_chip = CHIPS[family].cores_per_chip(lnc)
    total = chips * per_chip if chips else (instance.chips * per_chip if instance else None)
    hbm = None
    memory = next(((step, p) for step, p in probes if p.chip_memory
                   and (p.family == family or p.provisional)), None)
    if memory is not None:  # per chip: split over the cores the resolved LNC gives
        step, p = memory
        hbm = p.chip_memory // per_chip
        if p.cores and chips and p.cores != chips * per_chip:
            notes.append(Evidence(step, f"{p.cores} cores counted on {chips} chips, but "
                                        f"{family} at LNC {lnc} has {per_chip} per chip; "
                                        f"HBM per core is the chip's over {per_chip}"))
    kind = jax_probe.device_kind if jax_probe else None
    if jax_probe is not None and jax_probe.cores:
        cores = jax_probe.cores  # the runtime has already applied the visible-core variables
        _visible_cores(env, total)  # but a bad value is refused here too, as on every path
        applied = [f"{k}={_show(env[k], 40)[1:-1]}" for k in
                   ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES") if env.get(k, "").strip()]
        if applied:
            notes.append(Evidence("env", f"{', '.join(applied)}: already applied by the "
                                         f"runtime, which shows JAX {cores} cores"))
    else:
        n, visible_note = _visible_cores(env, total)
        cores = n if n is not None else (total or per_chip)
        if visible_note:
            notes.append(Evidence("env", visible_note))
    return _spec(family, instance=instance, lnc=lnc, source=source, chips=chips, cores=cores,
                 hbm=hbm, device_kind=kind, evidence=_mark_decided(notes, source))


def _lnc_choices(family: str) -> str:
    options = CHIPS[family].lnc_options
    return ("no logical-core configuration" if not options
            else "LNC " + " or ".join(map(str, options)))


def _mark_decided(notes: list[Evidence], step: str) -> tuple[Evidence, ...]:
    """Flag the first note of the deciding step."""
    out, done = [], False
    for note in notes:
        if not done and note.step == step:
            note, done = dataclasses.replace(note, decided=True), True
        out.append(note)
    return tuple(out)
