"""The harness's own machinery, above the adapters: the command line (`cli`), the pytest plugin
(`plugin`), repro bundles (`repro`), the ledger's fixes and the kernel mutants as tree edits
(`fixes`), pytest-xdist scale-out (`scaleout`) and the nightly loop (`nightly`: report, bisect)."""
