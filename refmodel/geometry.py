"""Frozen geometry configs of the three K3 paths, and presets by name.

Values of the full presets come from the project brief (BRIEF §1-3), which
quotes the published K3 DSpark / DFlash configs and the vLLM 0.33.0 model
code. The tiny presets keep the same structure (several draft layers, a
partial-width rope head, several AttnRes blocks, several taps) at sizes that
run in milliseconds on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RopeStyle = Literal["gptj", "neox"]


@dataclass(frozen=True)
class YarnScaling:
    """YaRN context extension (Peng et al. 2023) as DeepSeek-style models use it."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"YarnScaling.factor: expected > 0, got {self.factor}")
        if self.original_max_position <= 0:
            raise ValueError(
                "YarnScaling.original_max_position: expected > 0, "
                f"got {self.original_max_position}"
            )


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding: `rotary_dim` leading dims of a head are rotated.

    style "gptj" rotates pairs (2i, 2i+1); "neox" rotates pairs (i, i + rotary_dim/2).
    """

    rotary_dim: int
    theta: float
    style: RopeStyle = "gptj"
    yarn: YarnScaling | None = None

    def __post_init__(self) -> None:
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(
                f"RopeSpec.rotary_dim: expected a positive even int, got {self.rotary_dim}"
            )
        if self.theta <= 1.0:
            raise ValueError(f"RopeSpec.theta: expected > 1, got {self.theta}")
        if self.style not in ("gptj", "neox"):
            raise ValueError(f"RopeSpec.style: expected 'gptj' or 'neox', got {self.style!r}")


@dataclass(frozen=True)
class MLADraftGeometry:
    """The DSpark MLA draft: L draft layers reading one context stream."""

    hidden: int
    num_layers: int
    q_lora_rank: int
    kv_lora_rank: int
    rope_head_dim: int
    eps: float
    rope: RopeSpec
    target_taps: tuple[int, ...]

    @property
    def kv_width(self) -> int:
        """Width of one layer's kv_a_proj_with_mqa output: kv_lora + rope (576 in K3)."""
        return self.kv_lora_rank + self.rope_head_dim

    @property
    def fused_qkv_a_width(self) -> int:
        """Width of one layer's fused_qkv_a_proj output: q_lora + kv_width (2112 in K3)."""
        return self.q_lora_rank + self.kv_width


@dataclass(frozen=True)
class AttnResGeometry:
    """Block AttnRes: depth-wise softmax mixing over committed blocks + the prefix."""

    num_layers: int
    block_size: int
    hidden: int
    eps: float

    @property
    def num_blocks(self) -> int:
        """Bank rows: cdiv(num_layers, block_size) (8 in K3)."""
        return -(-self.num_layers // self.block_size)

    @property
    def max_sources(self) -> int:
        """Committed blocks plus the running prefix (9 in K3)."""
        return self.num_blocks + 1


@dataclass(frozen=True)
class DFlashGeometry:
    """The K3-DFlash draft: GQA K/V per draft layer from the projected taps."""

    hidden: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope: RopeSpec
    target_taps: tuple[int, ...]
    sliding_window: int

    @property
    def fc_in_features(self) -> int:
        """Columns of the tap projection: one hidden-wide block per tap."""
        return self.hidden * len(self.target_taps)


_K3_YARN = YarnScaling(
    factor=32.0,
    original_max_position=32768,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

Geometry = MLADraftGeometry | AttnResGeometry | DFlashGeometry

PRESETS: dict[str, Geometry] = {
    "k3-dspark": MLADraftGeometry(
        hidden=7168,
        num_layers=5,
        q_lora_rank=1536,
        kv_lora_rank=512,
        rope_head_dim=64,
        eps=1e-5,
        rope=RopeSpec(rotary_dim=64, theta=50000.0, style="gptj", yarn=_K3_YARN),
        target_taps=(2, 23, 47, 71, 89),
    ),
    "k3-dspark-plain-rope": MLADraftGeometry(
        hidden=7168,
        num_layers=5,
        q_lora_rank=1536,
        kv_lora_rank=512,
        rope_head_dim=64,
        eps=1e-5,
        rope=RopeSpec(rotary_dim=64, theta=50000.0, style="gptj", yarn=None),
        target_taps=(2, 23, 47, 71, 89),
    ),
    "k3-attnres": AttnResGeometry(num_layers=93, block_size=12, hidden=7168, eps=1e-5),
    # The brief gives the DFlash draft's layer count, GQA shape, taps, NeoX style
    # and window; it does not give its rope theta, so the DSpark value is assumed.
    "k3-dflash": DFlashGeometry(
        hidden=7168,
        num_layers=6,
        num_kv_heads=8,
        head_dim=128,
        eps=1e-5,
        rope=RopeSpec(rotary_dim=128, theta=50000.0, style="neox", yarn=None),
        target_taps=(19, 37, 54, 66, 78, 90),
        sliding_window=4096,
    ),
    "tiny-dspark": MLADraftGeometry(
        hidden=48,
        num_layers=3,
        q_lora_rank=24,
        kv_lora_rank=16,
        rope_head_dim=8,
        eps=1e-5,
        rope=RopeSpec(
            rotary_dim=8,
            theta=50000.0,
            style="gptj",
            yarn=YarnScaling(factor=4.0, original_max_position=64),
        ),
        target_taps=(1, 3, 5),
    ),
    "tiny-dspark-plain-rope": MLADraftGeometry(
        hidden=48,
        num_layers=3,
        q_lora_rank=24,
        kv_lora_rank=16,
        rope_head_dim=8,
        eps=1e-5,
        rope=RopeSpec(rotary_dim=8, theta=50000.0, style="gptj", yarn=None),
        target_taps=(1, 3, 5),
    ),
    "tiny-attnres": AttnResGeometry(num_layers=10, block_size=3, hidden=32, eps=1e-5),
    "tiny-dflash": DFlashGeometry(
        hidden=32,
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        eps=1e-5,
        rope=RopeSpec(rotary_dim=16, theta=50000.0, style="neox", yarn=None),
        target_taps=(1, 4, 7),
        sliding_window=64,
    ),
}


def preset(name: str) -> Geometry:
    """Look a preset up by name; unknown names list the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset: unknown name {name!r}; known: {sorted(PRESETS)}") from None
