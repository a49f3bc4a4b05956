"""SRDD task family: data, codebase parsing, static analysis, scoring, the family."""
