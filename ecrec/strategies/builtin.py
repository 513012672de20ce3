"""The specs of the strategies that ship with ``ecrec``: ``none`` and ``ecrec`` (entry points name them).

Specs are light: they import the strategies' options, not their server-side classes.
"""

from __future__ import annotations

from ecrec.strategies.erasure import options as erasure_options
from ecrec.strategies.spec import StrategySpec

NONE = StrategySpec(
    name="none", kind="none", summary="no fault tolerance; a replacement starts from initial values",
    options_type=None, server_class="ecrec.strategies.none:NoFaultTolerance", rank=0,
)

ECREC = StrategySpec(
    name="ecrec", kind="erasure",
    summary="rows + optimizer state in RS(k, m) stripes, parity rotating over servers; dense tensors on m+1 "
            "servers; recovery while training",
    options_type=erasure_options.ErasureOptions, server_class="ecrec.strategies.erasure.strategy:ErasureCoding",
    layout=erasure_options.layout_params, parser=erasure_options.parse, rank=30,
)
