"""The Mobius MIP: its cut variables, one solve per stage count, and the solvers (HiGHS, Gurobi)."""
