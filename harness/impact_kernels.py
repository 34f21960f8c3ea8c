"""Case classes of the ledger's AttnRes-kernel and FP8-cache entries through the draft step (`k3num impact
--ledger`): what the entry's defect does to the draft's tokens when the call that triggers it reaches the step.

The step's path 2 (harness/draft_step.py) is a read-only mixture of the target's stream: no delta, no bank write,
a bank that holds every block the mixture reads, and the target's layers are not in the step (their stream is
its input). So no call the step makes triggers these entries. Each case class makes the call the entry needs, on
the entry's engine: the tap's own call (K3N-004/005/009/010), a target layer's call whose output reaches the
stream (K3N-007/008), or the cache the context entries pass through (K3N-014); the row's `paths` says which:

- K3N-004 / K3N-005 (`written_in_the_mix`): the tap's caller also stores the stream as bank block 0 inside the
  mixed range, in the same call (block_write_idx 0). The intended mixture reads the written row; the race
  mixes the row's old value. Every side's bank holds the written row; the engine's call gets the old one and
  the write.
- K3N-007 (`raced_layer_input`): the race is in the decoder layer's own call (a delta, the output norm, the
  4-source tile: the ledger's reproducer's hidden 128 and 4 of 4 blocks, fewer than 256 tokens): it stores
  prefix + delta in place, and a raced call mixes a segment of the prefix with the delta added twice, so the
  layer's normed input is wrong (the stored prefix is right). That input reaches the stream through the layer's
  sublayer, which the step does not hold: a linear stand-in (a drawn [H, H] matrix of gain about 1) turns the
  layer input into the pending output the tap then adds. Every side's tap state is (prefix + delta, the stand-in
  of the most frequent output); the engine's tap takes the stand-in of the raced one, through the mirror's tap,
  so K3N-001 stays out.
- K3N-008 (`unwritten_layer_input`): SGLang's model aggregation (AttnResidual) forms the layer's normed input
  over the bank's every block; at a hidden size that is not a multiple of 1024 (the step's 32 and 64) its fused
  path writes no element of it. The unwritten memory is read as zeros here (the kindest: NaN memory would make
  every logit NaN), through the same linear stand-in as K3N-007; every other side takes the float64 aggregation
  rounded once. The control is hidden 1024, on the grid, where the fused path writes every element.
- K3N-009 / K3N-010 (`bank_one_block_short`): the caller sized the bank one block short of what the mixture
  reads (num_blocks = the rows it allocated + 1). The kernel reads the next token's first row in the missing
  row's place, and the last token reads the allocation's tail, which here is zeros. Deterministic.
- K3N-014 (`through_an_fp8_cache`): the DSpark context entries written to an FP8 (e4m3) cache by vLLM's
  compiled per-layer insert and read back dequantized with the same scale, one layer's scale 0 (the case: layer 1,
  layer 0 of a one-layer draft) or
  every layer's scale amax / 448 (the control: what an FP8 cache itself does to the tokens).

A race's case class makes each of its calls `repeats` times on fresh copies: the most frequent output is the
un-raced one, and the step takes the raced output farthest from it (the worst call seen); `Calls` counts them.
On the CPU the Triton interpreter runs a kernel's programs one after another, so a race cannot happen there: the
ledger table then says so instead of reporting "no token changes".
"""

from __future__ import annotations

import dataclasses as dc
from dataclasses import dataclass, field
from typing import Any

import torch

from k3num.engines import base
from k3num.harness.draft_step import EPS  # the AttnRes norms' eps
from k3num.refmodel.attn_res import LayerWiring, aux_tap_branch

WRITE_ROW = 0  # the bank row K3N-004/005's caller writes inside the mixed range (the ledger's reproducer's)
RACE_REPEATS = 200  # calls per tap on the GPU (the ledger's reproducers count races in 200 calls)
FP8_MAX = 448.0  # e4m3's largest finite value: a scale of amax / 448 puts a layer's largest entry there
SGLANG_TILE = 1024  # the chunk SGLang's fused aggregation loads without a mask (K3N-008)


@dataclass
class Calls:
    """The calls a row's case class made to the entry's kernel, and for a race those whose output was not the most
    frequent one."""

    calls: int = 0
    raced: int = 0
    taps: list[int] = field(default_factory=list)  # the tap layers the case's call was made at
    label: str = ""  # what the call was made over (bank_one_block_short: "a bank one block short")

    def note(self) -> str:
        return f"{self.calls} calls; {self.label}" if self.label else f"raced {self.raced} of {self.calls} calls"


def worst_of(call: Any, repeats: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`call()` (a fresh call each time -> one tensor) `repeats` times -> (the output the step takes, the most
    frequent output, raced calls): the step takes the most frequent output when no call differs from it, else the
    raced output farthest from it (max |diff|)."""
    outs = torch.stack([call() for _ in range(repeats)])
    if repeats == 1:
        return outs[0], outs[0], 0
    flat = outs.reshape(repeats, -1)
    bits = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    _, inverse, counts = torch.unique(bits, dim=0, return_inverse=True, return_counts=True)
    modal = int(counts.argmax())
    raced = int(repeats - counts[modal])
    first = int((inverse == modal).nonzero()[0, 0])
    if not raced:
        return outs[first], outs[first], 0
    far = (flat.float() - flat[first].float()).abs().nan_to_num(float("inf")).amax(1)
    return outs[int(far.argmax())], outs[first], raced


def _branch(layer: int, kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    got = aux_tap_branch(layer, kw["weights"], kw["block_size"], kw["end_layer"], kw["num_layers"],
                         kw["is_last_rank"])
    if got is None:
        raise ValueError(f"tap after layer {layer}: the last layer of a non-final stage (no mixture to call)")
    return got


def mixed_taps(case: Any) -> list[int]:
    """The case's tap layers whose mixture reads at least two blocks (where a row can be written inside the mix
    beside another, or the bank can be one short and still hold a row)."""
    def blocks(layer: int) -> int:  # aux_tap_branch's: layer i + 1's prev_valid_blocks, or cdiv(L, S) after the last
        if layer + 1 < case.target_layers:
            return LayerWiring(layer + 1, case.attn_res_block).prev_valid_blocks
        return -(-case.target_layers // case.attn_res_block)

    return [layer for layer in case.tap_layers() if blocks(layer) >= 2]


def written_in_the_mix(engine: Any, mirror: Any, repeats: int) -> tuple[Any, Any, Calls]:
    """K3N-004/005's case class (module docstring): (inputs hook, subjects hook, the race's count)."""
    count = Calls()
    stale: dict[int, torch.Tensor] = {}

    def inputs(inp: Any, case: Any) -> Any:
        stale.clear()
        count.taps = mixed_taps(case)
        states = []
        for layer, (prefix, pending, bank) in zip(case.tap_layers(), inp.tap_states):
            if layer in count.taps:
                stale[layer] = bank[:, WRITE_ROW].clone()
                bank = bank.clone()
                bank[:, WRITE_ROW] = prefix + pending  # the stream the call writes, as the engine forms it
            states.append((prefix, pending, bank))
        return dc.replace(inp, tap_states=states)

    kernel, plain = engine.subject(base.ATTN_RES), mirror.subject(base.AUX_CAPTURE)

    def tap(layer: int, prefix: Any, pending: Any, bank: Any, **kw: Any) -> Any:
        if layer not in stale:
            return plain(layer, prefix, pending, bank, **kw)
        norm, proj, nbl = _branch(layer, kw)
        stream = prefix + pending
        old = bank.clone()
        old[:, WRITE_ROW] = stale[layer]

        def call() -> torch.Tensor:
            return kernel(stream.clone(), None, old.clone(), norm, proj, None, nbl, WRITE_ROW, kw["eps"], 0.0)

        out, _, raced = worst_of(call, repeats)
        count.calls += repeats
        count.raced += raced
        return out

    def subjects(case: Any) -> dict[str, Any]:
        return {base.AUX_CAPTURE: (tap, f"{engine.name} attn_res writing the stream as block {WRITE_ROW} "
                                        "inside the mix (taps mixing >= 2 blocks; the others the mirror's)")}

    return inputs, subjects, count


def _stand_in_sublayer(case: Any, like: torch.Tensor) -> torch.Tensor:
    """[H_out, H_in]: the linear stand-in for the target layer's sublayer (K3N-007/008's case classes), drawn from
    the case's seed, gain about 1, in `like`'s dtype and device."""
    gen = torch.Generator().manual_seed(case.seed)
    h = case.hidden
    return (torch.randn(h, h, generator=gen, dtype=torch.float64) * h ** -0.5).to(like.dtype).to(like.device)


def _through_the_layer(layer_input: Any, count: Calls, mirror: Any, label: str) -> tuple[Any, Any]:
    """(inputs hook, subjects hook) of a case class whose defect is in a target layer's AttnRes call: each tap's
    state becomes (prefix + delta, the stand-in sublayer of the layer's input, bank), the input `layer_input(layer,
    prefix, pending, bank, weights) -> (the engine's, the one every other side takes)` gives; the engine's tap is
    the mirror's over its own."""
    plain = mirror.subject(base.AUX_CAPTURE)
    engine_pending: dict[int, torch.Tensor] = {}

    def inputs(inp: Any, case: Any) -> Any:
        engine_pending.clear()
        count.taps = list(case.tap_layers())
        sub = _stand_in_sublayer(case, inp.fc).float()
        states = []
        for layer, (prefix, pending, bank) in zip(count.taps, inp.tap_states):
            got, intended = layer_input(layer, prefix, pending, bank, inp.target_weights)
            engine_pending[layer] = (got.float() @ sub.T).to(prefix.dtype)
            states.append((prefix + pending, (intended.float() @ sub.T).to(prefix.dtype), bank))
        return dc.replace(inp, tap_states=states)

    def tap(layer: int, prefix: Any, pending: Any, bank: Any, **kw: Any) -> Any:
        return plain(layer, prefix, engine_pending[layer], bank, **kw)

    return inputs, lambda case: {base.AUX_CAPTURE: (tap, label)}


def raced_layer_input(engine: Any, mirror: Any, repeats: int) -> tuple[Any, Any, Calls]:
    """K3N-007's case class (module docstring): (inputs hook, subjects hook, the race's count)."""
    count = Calls()
    kernel = engine.subject(base.ATTN_RES)

    def layer_input(layer: int, prefix: Any, pending: Any, bank: Any, w: Any) -> tuple[torch.Tensor, torch.Tensor]:
        def call() -> torch.Tensor:
            return kernel(prefix.clone(), pending.clone(), bank.clone(), w.attn_res_norm[layer], w.attn_res_proj[layer],
                          w.input_layernorm[layer], bank.shape[1], -1, EPS, EPS)

        worst, modal, raced = worst_of(call, repeats)
        count.calls += repeats
        count.raced += raced
        return worst, modal

    return (*_through_the_layer(layer_input, count, mirror, f"the mirror's tap over {engine.name} attn_res's layer "
                                "input (with its delta and output norm, over the bank's every block) through a "
                                "linear stand-in sublayer"), count)


def unwritten_layer_input(engine: Any, mirror: Any) -> tuple[Any, Any, Calls]:
    """K3N-008's case class (module docstring): (inputs hook, subjects hook, the calls made)."""
    from k3num.harness.judges import residual_mixture
    from k3num.oracles.hunt import poisoned_allocations

    count = Calls(label="unwritten memory read as zeros")
    aggregate = engine.subject(base.ATTN_RES_RESIDUAL)

    def layer_input(layer: int, prefix: Any, pending: Any, bank: Any, w: Any) -> tuple[torch.Tensor, torch.Tensor]:
        stream, (tokens, nvb, hidden) = prefix + pending, bank.shape
        weights = (w.attn_res_norm[layer], w.attn_res_proj[layer], w.input_layernorm[layer])
        # the fused path reads whole SGLANG_TILE-element chunks past each row: zero rows after the bank's and the
        # stream's, so every read lands in memory of ours
        pad = -(-SGLANG_TILE // hidden) + 1
        padded_bank = torch.zeros(tokens, nvb + pad, hidden, dtype=bank.dtype, device=bank.device)
        padded_bank[:, :nvb] = bank
        padded_stream = torch.zeros(tokens + pad, hidden, dtype=stream.dtype, device=stream.device)
        padded_stream[:tokens] = stream
        with poisoned_allocations(fill=torch.Tensor.zero_):
            got = aggregate(padded_stream[:tokens], padded_bank, nvb, *weights, EPS)
        want, _ = residual_mixture(engine, stream, bank, nvb, *weights, EPS)  # float64
        count.calls += 1
        return got, want.to(stream.dtype)

    return (*_through_the_layer(layer_input, count, mirror, f"the mirror's tap over {engine.name}'s model "
                                "aggregation (AttnResidual, over the bank's every block; memory it leaves unwritten "
                                "read as zeros) through a linear stand-in sublayer"), count)


def bank_one_block_short(engine: Any, mirror: Any, short: bool = True) -> tuple[Any, Any, Calls]:
    """K3N-009/010's case class (module docstring): (inputs hook, subjects hook, the tap calls made). short=False:
    the control, the same call over a bank that holds every row the mixture reads."""
    count = Calls(label="a bank one block short" if short else "a right-sized bank")
    kernel, plain = engine.subject(base.ATTN_RES), mirror.subject(base.AUX_CAPTURE)

    def inputs(inp: Any, case: Any) -> Any:
        count.taps = mixed_taps(case)
        return inp

    def tap(layer: int, prefix: Any, pending: Any, bank: Any, **kw: Any) -> Any:
        if layer not in count.taps:
            return plain(layer, prefix, pending, bank, **kw)
        norm, proj, nbl = _branch(layer, kw)
        tokens, _, hidden = bank.shape
        rows = nbl - 1 if short else nbl
        # the allocation: `rows` rows per token and a zero tail past the last token's rows
        alloc = torch.zeros(tokens + 1, rows, hidden, dtype=bank.dtype, device=bank.device)
        alloc[:tokens] = bank[:, :rows]
        count.calls += 1
        return kernel(prefix + pending, None, alloc[:tokens], norm, proj, None, nbl, -1, kw["eps"], 0.0)

    def subjects(case: Any) -> dict[str, Any]:
        return {base.AUX_CAPTURE: (tap, f"{engine.name} attn_res over {count.label} (taps mixing >= 2 "
                                        "blocks; the others the mirror's)")}

    return inputs, subjects, count


def through_an_fp8_cache(engine: Any, bad_layer: int | None) -> Any:
    """K3N-014's case class (module docstring): a subjects hook whose DSpark context KV is the engine's fused
    path's entries through vLLM's compiled FP8 insert (engine.extras["context_kv_ops"]) and back. bad_layer: the
    layer whose scale is 0, mod the draft's L layers (None: every layer at amax / 448, the control)."""
    ops = engine.extras["context_kv_ops"]
    fused = engine.subject(base.CONTEXT_KV_FUSED)

    def context_kv(x: Any, kv_a: Any, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kv_c, k_pe = fused(x, kv_a, *rest)
        layers, tokens, lora = kv_c.shape
        width = lora + k_pe.shape[-1]
        amax = torch.cat([kv_c, k_pe], -1).float().abs().amax(dim=(1, 2)).clamp_min(1e-12)
        scales = (amax / FP8_MAX).to(torch.float32)
        if bad_layer is not None:
            scales[bad_layer % layers] = 0.0
        slots = torch.arange(tokens, device=kv_c.device, dtype=torch.int64)
        back = []
        for layer in range(layers):
            cache = torch.zeros(1, tokens, width, dtype=torch.uint8, device=kv_c.device)
            ops.insert_per_layer(kv_c[layer], k_pe[layer], cache, slots, "fp8_e4m3", scales[layer:layer + 1])
            entry = cache[0].view(torch.float8_e4m3fn).float() * scales[layer]
            back.append(entry.to(kv_c.dtype))
        out = torch.stack(back)
        return out[..., :lora].contiguous(), out[..., lora:].contiguous()

    label = (f"{engine.name}(entries through its FP8 insert, scales amax / 448)" if bad_layer is None
             else f"{engine.name}(entries through its FP8 insert, layer {bad_layer} mod L's scale 0)")
    return lambda case: {base.CONTEXT_KV_FUSED: (context_kv, label)}
