"""Seeds: serve a rank's weights in place for one-sided reads and stay published at the planner."""
