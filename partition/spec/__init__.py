"""What is planned: model specs (built-in and Hugging Face), hardware, per-layer profiles, the analytic profile."""
