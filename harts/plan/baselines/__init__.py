"""Planning baselines the paper compares against (§5.2). OR-Tools is imported lazily."""
