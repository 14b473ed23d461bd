"""Simulations that drive the real planner on simulated time (see bench.simulate.fleet)."""
