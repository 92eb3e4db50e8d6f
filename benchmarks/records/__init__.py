"""Records of finished runs: their evaluations written to benchmarks/results/ and docs/BENCHMARKS.md."""
