"""The text of a repro's standalone script and of its pytest file (written by :mod:`.repro`).

The script needs only torch (and the device's extension): it reads ``case.safetensors`` with a
reader of its own (the format is an 8-byte header length, a JSON header, raw little-endian
bytes) and ``case.json``, runs the op on the device, and judges its outputs against the float64
golden with the verdict's recorded bounds (the peer rule's numbers: docs/bisect.md, "Repro").
"""
from __future__ import annotations

__all__ = ["SCRIPT", "PYTEST"]

SCRIPT = r'''#!/usr/bin/env python3
"""Standalone reproducer of a kernel finding, written by precisiondiff (needs only torch).

    python repro.py [--device DEVICE]

Runs the recorded op on the device with the recorded inputs and compares its outputs with the
float64 golden (golden.*) under the bounds of the verdict (case.json: "outputs"). Prints the
finding; exits 1 while the kernel is wrong, 0 once it is fixed, 2 when it cannot run.
Extension modules to import first (a device backend): REPRO_IMPORT=mod1,mod2; an `mlu` device
imports torch_mlu when nothing registered it.
"""
import importlib
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def read_safetensors(path):
    """name -> tensor, from a safetensors file (no safetensors package needed)."""
    with open(path, "rb") as fh:
        raw = fh.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    body = bytearray(raw[8 + n:])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        flat = torch.frombuffer(body, dtype=dtype, offset=start, count=(end - start) // torch.empty(0, dtype=dtype).element_size()) \
            if end > start else torch.empty(0, dtype=dtype)
        out[name] = flat.clone().reshape(info["shape"])
    return out


def in_layout(t, entry, device):
    """The tensor in the layout the recorded call saw (its strides and storage offset): a kernel
    may take another path, and round differently, for another layout. Arguments that viewed one
    storage get a buffer each; a layout that cannot be rebuilt (overlapping) stays contiguous."""
    if "stride" not in entry and "offset" not in entry:
        return t.to(device)
    stride = entry.get("stride") or list(t.contiguous().stride())
    offset = entry.get("offset", 0)
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, stride)) if t.numel() else 0
    try:
        view = torch.zeros(offset + extent, dtype=t.dtype, device=device).as_strided(t.shape, stride, offset)
        view.copy_(t.to(device))
        return view
    except RuntimeError:
        return t.to(device)


def decode(v, tensors, device):
    """The recorded arguments (precisiondiff's replay encoding) as Python values."""
    if isinstance(v, list):
        return [decode(x, tensors, device) for x in v]
    if not isinstance(v, dict):
        return v
    if "t" in v:
        return in_layout(tensors[v["t"]], v, device)
    if "f" in v:
        return float(v["f"])
    if "like" in v:
        shape = v["like"]["shape"]
        stride = v["like"].get("stride") or torch.empty(shape, device="meta").stride()
        return torch.empty_strided(shape, stride, dtype=getattr(torch, v["like"]["dtype"]), device=device).zero_()
    if "dtype" in v:
        return getattr(torch, v["dtype"])
    if "device" in v:
        return torch.device(device)
    if "layout" in v:
        return {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}[v["layout"]]
    if "memory_format" in v:
        return getattr(torch, v["memory_format"].removeprefix("torch."))
    if "tuple" in v:
        return tuple(decode(x, tensors, device) for x in v["tuple"])
    if "dict" in v:
        return {k: decode(x, tensors, device) for k, x in v["dict"].items()}
    raise ValueError(f"argument not replayable: {v}")


def resolve(name):
    """torch.ops.<ns>.<op>.<overload> from "aten.addmm.default"."""
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def load_device(device):
    for mod in filter(None, (m.strip() for m in os.environ.get("REPRO_IMPORT", "").split(","))):
        importlib.import_module(mod)
    kind = device.split(":")[0]
    if kind == "mlu" and getattr(torch, "mlu", None) is None:
        importlib.import_module("torch_mlu")


def flat_outputs(value):
    if isinstance(value, torch.Tensor):
        return [value]
    found = []
    for v in value if isinstance(value, (list, tuple)) else []:
        found += flat_outputs(v)
    return found


def judge(out, golden, scale, spec):
    """(wrong, sentence): the peer rule's tests with the verdict's bounds."""
    g = golden.to(torch.float64).flatten()
    d = out.detach().cpu().to(torch.float64).flatten()
    if d.shape != g.shape:
        return True, f"shape {tuple(out.shape)} != golden {tuple(golden.shape)}"
    finite = torch.isfinite(d) & torch.isfinite(g)
    rounded = g.to(out.dtype).to(torch.float64)
    special = int((~finite & ~((d == rounded) | (torch.isnan(d) & torch.isnan(rounded)))).sum())
    zero = torch.zeros_like(g)
    gnorm = float(torch.linalg.vector_norm(torch.where(finite, g, zero)))
    err = float(torch.linalg.vector_norm(torch.where(finite, d - g, zero)))
    rel = err / gnorm if gnorm > 0 else (0.0 if err == 0 else math.inf)
    worst = float(torch.where(finite, (d - g).abs() / scale.flatten(), zero).max()) if d.numel() else 0.0
    l2_wrong = spec["l2_judged"] and rel > spec["bound"]
    max_wrong = worst > spec["max_bound"]
    parts = [f"relative L2 error {rel:.3g} (bound {spec['bound']:.3g}" +
             ("" if spec["l2_judged"] else ", not judged on a slice") + ")",
             f"worst element {worst:.3g} ULP of the element or the significance threshold (bound {spec['max_bound']:.3g})"]
    if special:
        parts.append(f"{special} NaN/Inf where the golden has none")
    return bool(special or l2_wrong or max_wrong), "; ".join(parts)


def main(argv):
    with open(os.path.join(HERE, "case.json"), encoding="utf-8") as fh:
        case = json.load(fh)
    device = case["device"]
    if "--device" in argv:
        device = argv[argv.index("--device") + 1]
    try:
        load_device(device)
        data = read_safetensors(os.path.join(HERE, "case.safetensors"))
        args = decode(case["args"], data, device)
        kwargs = decode(case["kwargs"], data, device)
        with torch.no_grad():
            outs = flat_outputs(resolve(case["op"])(*args, **kwargs))
    except (ImportError, RuntimeError, AttributeError, ValueError) as err:
        print(f"error: cannot run {case['op']} on {device}: {type(err).__name__}: {str(err).splitlines()[0]}")
        return 2
    f = case["finding"]
    print(f"{case['op']} on {device} ({case['target']}), recorded in {f.get('scope') or '<root>'} "
          f"({f.get('direction')}, call {f.get('call')}); reference {case['ref']}")
    wrong_any = False
    for spec in case["outputs"]:
        wrong, sentence = judge(outs[spec["index"]], data["golden." + spec["slot"]], data["scale." + spec["slot"]], spec)
        wrong_any |= wrong
        peers = ", ".join(f"{k} {v:.3g}" for k, v in spec["peers"].items() if v is not None) or "none"
        print(f"  {spec['slot']}: {'WRONG' if wrong else 'ok'}: {sentence}")
        print(f"    recorded: DUT error {spec['error']:.3g}, peers' errors ({peers}), bound = {spec['factor']:g} x "
              f"{spec['peer_error']:.3g} + floor {spec['floor']:.3g}")
    print("the kernel is still wrong (exit 1)" if wrong_any else "the kernel is within the bounds: fixed (exit 0)")
    return 1 if wrong_any else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''

PYTEST = r'''"""The repro's finding as a test through precisiondiff's pytest plugin (``check_op``):
fails while the kernel is wrong. Run: pytest test_repro.py (precisiondiff installed)."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import repro  # noqa: E402  (the standalone script beside this file)


def test_recorded_op_has_parity(parity):
    with open(os.path.join(HERE, "case.json"), encoding="utf-8") as fh:
        case = json.load(fh)
    repro.load_device(case["device"])
    data = repro.read_safetensors(os.path.join(HERE, "case.safetensors"))
    args = repro.decode(case["args"], data, "cpu")
    kwargs = repro.decode(case["kwargs"], data, "cpu")
    # fails the test (the plugin's mismatch message) while the op diverges on the target
    parity.check_op(repro.resolve(case["op"]), *args, kwargs=kwargs, target=case["target"], ref=case["ref"])
'''
