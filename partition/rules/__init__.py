"""The closed-form rules: cost model, stage order, mapping, the exact DP, activation and state placement, walks."""
