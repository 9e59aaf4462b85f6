"""Benchmarks: workloads, the one plain-against-methods runner, its records, reports and plots, replay, stand-ins and llama.cpp peers."""
