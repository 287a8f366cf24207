"""The paper's evaluation protocol: greedy noise-free evaluation, per-question records, exact McNemar
statistics, paper-style tables and figures."""
