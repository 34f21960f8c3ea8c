"""k3-numerics: the float64 oracle, the judge and the property suite for Kimi K3's speculative-decoding
paths, under one import name.

In a checkout the harness's folders sit at the repository's top (`refmodel/`, `oracles/`, `engines/`,
`supply/`, `harness/`, `fixtures/`, `properties/`) and this folder links to them; installed, they are
subpackages of this one. Either way they are imported as `k3num.refmodel`, `k3num.oracles`, ...:
the wheel claims no other top-level name.

For people writing their own tests: `k3num.api` (the oracle functions, the strategies and one judge
call). The pytest plugin (`k3num.harness.plugin`, entry point `k3num`) brings the options, fixtures,
hypothesis profiles and markers of the property suite.
"""
