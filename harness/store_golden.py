"""The bf16 stores of the pinned Triton kernels on stored inputs: captured on the GPU, checked under the
CPU interpreter (issue 20: the interpreter must round fp32 -> bf16 as the GPU does).

`capture` runs every case below through the engines' Triton subjects natively on a CUDA device and
saves the inputs and every bf16 tensor the kernels store (the output, the prefix written back, the
bank row written) in one safetensors file; `check` runs the same cases under the interpreter on the
stored inputs and compares each store with the GPU's, element by element.

Which stores must agree bit for bit: those whose fp32 value the two machines compute identically,
the prefix written back (fp32(prefix) + fp32(delta), one addition) and the bank row written (that
value again); there the rounding mode alone decides, and truncation differs from the GPU's round to
nearest even in about half the elements. The mixtures are sums over dot products, which the
interpreter reduces in numpy's order and the GPU in its own, so an fp32 value may differ in its last
bits and, near a rounding boundary, its bf16 rounding by one ulp; `check` counts those and the
largest difference in ulps, and tests/test_interpreter_rounding.py states their bound.

    python -m k3num.harness.store_golden capture OUT.safetensors   # on the H200
    python -m k3num.harness.store_golden check FILE                # here, under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3num.supply import env

LOW = torch.bfloat16
EPS, OUT_EPS = 1e-5, 1e-6


@dataclass(frozen=True)
class StoreCase:
    """One kernel call: the engine and subject, the shape, which in-place paths it takes."""

    engine: str
    subject: str
    tokens: int
    hidden: int
    bank: int
    num_blocks: int
    write: int = -1
    delta: bool = False
    out_norm: bool = False
    seed: int = 0

    @property
    def name(self) -> str:
        return (f"{self.engine}.{self.subject}.T{self.tokens}.H{self.hidden}.nb{self.num_blocks}.w{self.write}"
                f".d{int(self.delta)}.o{int(self.out_norm)}.s{self.seed}")


def cases() -> list[StoreCase]:
    out = []
    for engine in ("vllm", "vllm-rocm"):
        for tokens, hidden, bank, nb, write, delta, onorm in (
                (1, 64, 2, 0, 0, True, False), (3, 128, 4, 2, 2, True, True), (2, 256, 4, 4, -1, True, False),
                (4, 96, 3, 1, 1, False, True), (257, 64, 2, 2, -1, True, True)):
            for seed in (0,) if tokens > 256 else (0, 1):  # 257 tokens: vLLM's other tile (BLOCK_L) path
                out.append(StoreCase(engine, "attn_res", tokens, hidden, bank, nb, write, delta, onorm, seed))
    for tokens, nvb in ((1, 0), (2, 1), (3, 4)):
        for seed in (0, 1):
            out.append(StoreCase("sglang", "attn_res_mix_triton", tokens, 1024, 4, nvb, seed=seed))
    return out


def inputs(case: StoreCase) -> dict[str, torch.Tensor]:
    """The case's inputs on the CPU, bf16, from its seed (outliers included: large and small values)."""
    g = torch.Generator().manual_seed(1000 * case.seed + case.hidden + case.tokens)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
        spikes = torch.rand(*shape, generator=g, dtype=torch.float64) < 0.02
        return torch.where(spikes, x * 30.0, x).to(LOW)

    t = {"prefix": draw(case.tokens, case.hidden), "blocks": draw(case.tokens, case.bank, case.hidden),
         "norm": (torch.rand(case.hidden, generator=g, dtype=torch.float64) + 0.5).to(LOW),
         "qk": draw(case.hidden, scale=case.hidden ** -0.5)}
    if case.delta:
        t["delta"] = draw(case.tokens, case.hidden)
    if case.out_norm:
        t["out_norm"] = (torch.rand(case.hidden, generator=g, dtype=torch.float64) + 0.5).to(LOW)
    return t


def run(engine: Any, case: StoreCase, t: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """The stores of one call, on the CPU: `out`, and for attn_res the `prefix` and `blocks` after it."""
    d = {k: v.to(device).clone() for k, v in t.items()}
    fn = engine.subject(case.subject)
    if case.subject == "attn_res":
        out = fn(d["prefix"], d.get("delta"), d["blocks"], d["norm"], d["qk"], d.get("out_norm"), case.num_blocks,
                 case.write, EPS, OUT_EPS)
        return {"out": out.cpu(), "prefix": d["prefix"].cpu(), "blocks": d["blocks"].cpu()}
    out = fn(d["prefix"], d["blocks"], case.num_blocks, d["norm"], d["qk"], EPS)
    return {"out": out.cpu()}


def capture(path: Path, device: str = "cuda") -> Path:
    from safetensors.torch import save_file

    from k3num.engines import registry

    tensors, names = {}, []
    for case in cases():
        engine = registry.get(case.engine)
        t = inputs(case)
        for k, v in t.items():
            tensors[f"{case.name}/in/{k}"] = v.contiguous()
        for k, v in run(engine, case, t, device).items():
            tensors[f"{case.name}/out/{k}"] = v.contiguous()
        names.append(case.name)
    import triton

    meta = {"format": "k3num-bf16-stores-1", "device": torch.cuda.get_device_name(0) if device.startswith("cuda")
            else device, "torch": torch.__version__, "triton": triton.__version__,
            "engines": {e: registry.get(e).source_sha256.get("attn_res", registry.get(e).source_sha256.get(
                "attn_res_mix_triton", "")) for e in ("vllm", "vllm-rocm", "sglang")},
            "cases": names}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"k3num": json.dumps(meta)})
    return path


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps between two bf16 tensors (their bit patterns as ordered integers)."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        i = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (ordered(a) - ordered(b)).abs()


def check(path: Path, device: str = "cpu") -> list[dict[str, Any]]:
    """Each store of each stored case, run here on the stored inputs, against the captured one."""
    from safetensors import safe_open

    from k3num.engines import registry

    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata()["k3num"])
        stored = {k: fh.get_tensor(k) for k in fh.keys()}
    by_name = {c.name: c for c in cases()}
    rows = []
    for name in meta["cases"]:
        case = by_name[name]
        t = {k.split("/")[-1]: v for k, v in stored.items() if k.startswith(f"{name}/in/")}
        got = run(registry.get(case.engine), case, t, device)
        for k, mine in got.items():
            gpu = stored[f"{name}/out/{k}"]
            du = ulps(mine, gpu)
            rows.append({"case": name, "store": k, "numel": gpu.numel(), "differ": int((du > 0).sum()),
                         "max_ulps": int(du.max()) if du.numel() else 0})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3num.harness.store_golden", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("out", type=Path)
    k = sub.add_parser("check")
    k.add_argument("file", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "capture":
        print(f"[stores] {capture(args.out)}")
        return 0
    env.put_default("TRITON_INTERPRET", "1")
    rows = check(args.file)
    for r in rows:
        print(f"{r['case']:60s} {r['store']:7s} {r['differ']:6d} of {r['numel']:7d} differ, max {r['max_ulps']} ulp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
