"""Simulations that drive the real planner on simulated time (see rfork.simulate.fleet)."""
