"""Benchmarks: TensorHub beside a baseline measured in the same process tree
(these machines are noisy; only ratios within one run mean anything)."""
