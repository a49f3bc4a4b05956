"""SciCode task family: data, context code, harness, targets, comparison, the family."""
