"""What the ranks agree on before step 0: the plan, the state and activation tiers, the peer regions, the machine."""
