#!/usr/bin/env python
"""Run each kernel subject of the real engines once at small shapes (the program compute-sanitizer
watches; scripts/gpu_sanitize.py). Before each subject it prints a marker line (oracles.sanitizer.
MARKER + "engine subject case") and after it synchronises, so every report is attributed to the
subject that caused it. Cases: the model's calls, plus the ledger's off-path reproducers (K3N-008,
K3N-009), whose out-of-bounds accesses memcheck should see. Inputs are built as the properties build
them; allocations inside each call are poisoned (oracles.hunt)."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from k3num.engines import base, registry  # noqa: E402
from k3num.fixtures.strategies import AttnResCase, ContextKVCase, DraftKVCase, TapCase  # noqa: E402
from k3num.oracles import hunt, sanitizer  # noqa: E402
from k3num.properties.checks.determinism import KERNEL_SUBJECTS, attn_res_call  # noqa: E402
from k3num.refmodel.geometry import RopeSpec  # noqa: E402

ROPE = RopeSpec(rotary_dim=16, theta=10000.0, style="gptj")
A = dict(scale=1.0, outliers=0.0)
CASES = {
    base.ATTN_RES: [
        ("model:delta+onorm,nb=2,write=2", AttnResCase(3, 128, 4, 2, 2, True, True, 0, **A)),
        ("K3N-004:write-in-mix,H=32", AttnResCase(1, 32, 2, 2, 0, False, False, 0, **A)),
        ("K3N-007:delta+onorm,nb=4,H=128", AttnResCase(1, 128, 4, 4, -1, True, True, 0, **A)),
        ("lead-2:nb=0,delta+onorm,H=128", AttnResCase(1, 128, 4, 0, -1, True, True, 0, **A)),
        ("K3N-009:num_blocks>bank", AttnResCase(3, 32, 2, 3, -1, False, False, 0, **A)),
    ],
    base.AUX_CAPTURE: [("model:inner tap", TapCase(4, 2, 4, 1, 3, 64, 0))],
    base.CONTEXT_KV_FUSED: [("model:L=3", ContextKVCase(64, 3, 24, 32, ROPE, 5, 64, 0, **A))],
    base.ATTN_RES_MIX_TRITON: [("model:H=1024,nvb=3", (3, 1024, 3, 0))],
    base.ATTN_RES_RESIDUAL: [("model:H=1024,nvb=3", (3, 1024, 3, 0)), ("K3N-008:H=1536,nvb=2", (1, 1536, 2, 0))],
    base.DRAFT_CONTEXT_KV: [("model:L=2", DraftKVCase(64, 2, 2, 16, ROPE, 3, 0))],
}


OFF_PATH = ("K3N-009:num_blocks>bank", "K3N-008:H=1536,nvb=2")
# under initcheck: the self-tests' mutants that leave part of an output unwritten (tests/mutants.py), run
# beside the engines; their reads of the unwritten part must be reported, or the mode cannot see what it is for
UNWRITTEN_MUTANTS = ("attn_res_last_token_unwritten", "residual_tail_unwritten")
INITCHECK_NOTE = ("initcheck: allocations are not poisoned (the poison writes every byte, hiding exactly the "
                  "unwritten reads initcheck looks for); cuBLAS's kernels are not checked (gpu_sanitize.py: they "
                  "read their own split-K workspace, which initcheck reports as uninitialised on the H200: GPU run "
                  "56's control, a plain bf16 linear, 368,568 reports in cublasLt::splitKreduce_kernel) and torch "
                  "linear's outputs are zero-filled before cuBLAS writes them, so what reads them later is checked "
                  "against a tracked write; every output a subject returns is read once after its call, so an "
                  "element it left unwritten is reported in that subject's case")


def _gemm_outputs_initialised() -> None:
    """torch.nn.functional.linear with its output zero-filled (a write initcheck tracks) before cuBLAS writes
    it (one it does not track here): the stand-ins' and lifted code's GEMMs then read as initialised."""
    import torch.nn.functional as F

    plain = F.linear

    def linear(x, w, b=None):  # noqa: ANN001
        out = torch.zeros(*x.shape[:-1], w.shape[0], dtype=torch.result_type(x, w), device=x.device)
        torch.matmul(x, w.t(), out=out)
        return out + b if b is not None else out

    linear.plain = plain  # type: ignore[attr-defined]
    F.linear = linear


def _control() -> None:
    """The control of initcheck's blind spot: a plain linear (bf16 [64, 7168] x [2880, 7168]) then a permuted
    copy, as the context-KV stand-in does; with the fill above: no report."""
    x = torch.randn(64, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2880, 7168, device="cuda", dtype=torch.bfloat16)
    y = torch.nn.functional.linear(x, w).view(64, 5, 576).permute(1, 0, 2).contiguous()
    y.float().sum().item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engines", default="vllm,vllm-rocm,sglang")
    ap.add_argument("--cases", choices=["model", "off-path"], default="model",
                    help="model: the model's calls and the race reproducers; off-path: the out-of-bounds "
                         "reproducers (K3N-008, K3N-009), each best run in a process of its own: after the first "
                         "invalid access memcheck leaves the CUDA context unusable")
    ap.add_argument("--only", default="", help="run only the case whose label is this")
    ap.add_argument("--initcheck", action="store_true",
                    help="the run initcheck watches: " + INITCHECK_NOTE + "; the unwritten-output mutants run too")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sanitize_subjects: needs CUDA", file=sys.stderr)
        return 2
    failures = 0
    engines = args.engines.split(",")
    if args.initcheck:
        print(f"NOTE {INITCHECK_NOTE}", flush=True)
        _gemm_outputs_initialised()
        from tests import mutants

        for m in UNWRITTEN_MUTANTS:
            registry.register(f"mutant-{m}", lambda m=m: mutants.build(m))
        engines += [f"mutant-{m}" for m in UNWRITTEN_MUTANTS]
        print(f"{sanitizer.MARKER}control linear control:cuBLAS-output", flush=True)
        _control()
        torch.cuda.synchronize()
        print("   ran control linear control:cuBLAS-output", flush=True)
    for name in engines:
        try:
            engine = registry.get(name)
        except registry.EngineUnavailable as e:
            print(f"{sanitizer.MARKER}{name} - unavailable: {e}", flush=True)
            failures += 1
            continue
        for subj, cases in CASES.items():
            if not engine.provides(subj):
                continue
            make = attn_res_call if subj == base.ATTN_RES else KERNEL_SUBJECTS[subj][1]
            for label, case in cases:
                if (label in OFF_PATH) != (args.cases == "off-path") or (args.only and label != args.only):
                    continue
                print(f"{sanitizer.MARKER}{name} {subj} {label}", flush=True)
                try:
                    once = make(engine, engine.subject(subj), case, "cuda")
                    if args.initcheck:  # every output read once: an element left unwritten is reported here
                        outs, _ = once()
                        for t in outs:
                            t.float().sum().item()
                    else:
                        with hunt.poisoned_allocations():
                            once()
                    torch.cuda.synchronize()
                    print(f"   ran {name} {subj} {label}", flush=True)
                except Exception as e:  # a refusal, or a kernel that failed: reported, the run goes on
                    print(f"   raised {type(e).__name__}: {str(e)[:300]}", flush=True)
                    if "CUDA" in str(e) or "illegal" in str(e):
                        traceback.print_exc()
                        failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
