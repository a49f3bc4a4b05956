"""PyFuncs: a small verifiable function-writing family the embedded model can partly solve."""
