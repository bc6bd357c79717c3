"""The schedule the Analytic Configurator chooses for one kernel.

A ``LoweringConfig`` is plain data: the configurator produces it, the IR carries
it as ``#nova.lowering_config<...>`` on the op, and the Triton templates read it.
Fields that do not apply to a kernel kind keep their defaults.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class LoweringConfig:
    kind: str  # "matmul" | "reduction" | "elementwise" | "attention" | ...
    # contractions (reductions reuse block_m = rows per program, split_k = programs per row)
    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    group_m: int = 1  # L2 swizzle: tiles of GROUP_M rows of blocks are walked together
    split_k: int = 1
    persistent: bool = False
    # every kernel
    block: int = 0  # reductions / elementwise: elements per program along the fast axis
    num_warps: int = 4
    num_stages: int = 1
    # instruction path, e.g. "wgmma+tma", "mma", "fma"; "simt" for non-contractions
    instruction: str = "mma"
    # why: the regime the configurator classified the op into, e.g. "compute-bound"
    regime: str = ""
    # matmuls: the wave tail (configurator rule 8f). Where ``tail_at`` > 0, C's rows (``tail_axis``
    # "m") or columns ("n") before ``tail_at`` run at this config and the rest as a second launch
    # at ``configurator.tail_config`` (its tile, split ``tail_split`` ways along K)
    tail_at: int = 0
    tail_axis: str = ""
    tail_split: int = 1

    def to_dict(self) -> dict[str, int | str | bool]:
        """The fields, less the wave tail's where there is none (the IR of every other config
        stays as it was)."""
        d = asdict(self)
        if not self.tail_at:
            for f in _TAIL_FIELDS:
                del d[f]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LoweringConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown lowering_config fields: {sorted(unknown)}")
        return cls(**d)


_TAIL_FIELDS = ("tail_at", "tail_axis", "tail_split")
