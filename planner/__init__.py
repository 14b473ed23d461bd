"""The R-Fork planner: which running instance a new instance should pull its weights from."""
