"""Pictures and tables: timelines and traces, the baselines and the comparison, the activation choice explained."""
